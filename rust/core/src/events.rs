//! KV events queued by the engine, in the shape of vLLM's `BlockStored` / `BlockRemoved` /
//! `AllBlocksCleared`. The queue is a flat log (records pointing into shared hash and token
//! buffers) so that queueing an event allocates nothing once the buffers are warm.

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// A run of newly registered (immutable, verified) blocks of one request, in chain order.
    BlockStored {
        block_hashes: Vec<u64>,
        /// Hash of the block before the first one; `None` for a request's first block.
        parent_block_hash: Option<u64>,
        /// The tokens of every stored block, concatenated (`block_size` per block).
        token_ids: Vec<u32>,
        block_size: u32,
        lora_id: Option<u64>,
    },
    /// Blocks evicted from the registry.
    BlockRemoved { block_hashes: Vec<u64> },
    /// The whole registry was cleared.
    AllBlocksCleared,
}

/// A borrowed view of one queued event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvEventRef<'a> {
    BlockStored {
        block_hashes: &'a [u64],
        parent_block_hash: Option<u64>,
        token_ids: &'a [u32],
        block_size: u32,
        lora_id: Option<u64>,
    },
    BlockRemoved {
        block_hashes: &'a [u64],
    },
    AllBlocksCleared,
}

impl KvEvent {
    pub fn as_ref(&self) -> KvEventRef<'_> {
        match self {
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                lora_id,
            } => KvEventRef::BlockStored {
                block_hashes,
                parent_block_hash: *parent_block_hash,
                token_ids,
                block_size: *block_size,
                lora_id: *lora_id,
            },
            KvEvent::BlockRemoved { block_hashes } => KvEventRef::BlockRemoved { block_hashes },
            KvEvent::AllBlocksCleared => KvEventRef::AllBlocksCleared,
        }
    }
}

impl KvEventRef<'_> {
    pub fn to_owned(self) -> KvEvent {
        match self {
            KvEventRef::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                lora_id,
            } => KvEvent::BlockStored {
                block_hashes: block_hashes.to_vec(),
                parent_block_hash,
                token_ids: token_ids.to_vec(),
                block_size,
                lora_id,
            },
            KvEventRef::BlockRemoved { block_hashes } => KvEvent::BlockRemoved {
                block_hashes: block_hashes.to_vec(),
            },
            KvEventRef::AllBlocksCleared => KvEvent::AllBlocksCleared,
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum Kind {
    Stored {
        parent: Option<u64>,
        lora_id: Option<u64>,
    },
    Removed,
    Cleared,
}

#[derive(Debug, Clone, Copy)]
struct Record {
    kind: Kind,
    hashes_end: usize,
    tokens_end: usize,
}

#[derive(Debug, Clone, Default)]
pub struct EventLog {
    records: Vec<Record>,
    hashes: Vec<u64>,
    tokens: Vec<u32>,
    block_size: u32,
}

impl EventLog {
    pub fn new(block_size: u32) -> Self {
        EventLog {
            block_size,
            ..Default::default()
        }
    }
    pub fn len(&self) -> usize {
        self.records.len()
    }
    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }
    pub fn clear(&mut self) {
        self.records.clear();
        self.hashes.clear();
        self.tokens.clear();
    }

    fn close(&mut self, kind: Kind) {
        self.records.push(Record {
            kind,
            hashes_end: self.hashes.len(),
            tokens_end: self.tokens.len(),
        });
    }

    /// Opens a BlockStored event; add blocks with [`EventLog::push_stored_block`], then call
    /// [`EventLog::finish_stored`].
    pub fn push_stored_block(&mut self, hash: u64, tokens: &[u32]) {
        self.hashes.push(hash);
        self.tokens.extend_from_slice(tokens);
    }
    pub fn finish_stored(&mut self, parent: Option<u64>, lora_id: Option<u64>) {
        self.close(Kind::Stored { parent, lora_id });
    }
    /// Whether blocks were pushed since the last record.
    pub fn has_open_blocks(&self) -> bool {
        self.hashes.len() > self.records.last().map_or(0, |r| r.hashes_end)
    }
    pub fn push_removed(&mut self, hashes: &[u64]) {
        if hashes.is_empty() {
            return;
        }
        self.hashes.extend_from_slice(hashes);
        self.close(Kind::Removed);
    }
    pub fn push_cleared(&mut self) {
        self.close(Kind::Cleared);
    }

    pub fn iter(&self) -> impl ExactSizeIterator<Item = KvEventRef<'_>> + '_ {
        let mut h0 = 0;
        let mut t0 = 0;
        self.records.iter().map(move |r| {
            let (hs, ts) = (
                &self.hashes[h0..r.hashes_end],
                &self.tokens[t0..r.tokens_end],
            );
            h0 = r.hashes_end;
            t0 = r.tokens_end;
            match r.kind {
                Kind::Stored { parent, lora_id } => KvEventRef::BlockStored {
                    block_hashes: hs,
                    parent_block_hash: parent,
                    token_ids: ts,
                    block_size: self.block_size,
                    lora_id,
                },
                Kind::Removed => KvEventRef::BlockRemoved { block_hashes: hs },
                Kind::Cleared => KvEventRef::AllBlocksCleared,
            }
        })
    }

    /// Takes every queued event as owned values and empties the log (keeping its buffers).
    pub fn drain(&mut self) -> Vec<KvEvent> {
        let out = self.iter().map(KvEventRef::to_owned).collect();
        self.clear();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_round_trip() {
        let mut log = EventLog::new(2);
        log.push_stored_block(1, &[5, 6]);
        log.push_stored_block(2, &[7, 8]);
        assert!(log.has_open_blocks());
        log.finish_stored(None, Some(3));
        assert!(!log.has_open_blocks());
        log.push_removed(&[]);
        log.push_removed(&[1]);
        log.push_cleared();
        let ev = log.drain();
        assert_eq!(
            ev,
            vec![
                KvEvent::BlockStored {
                    block_hashes: vec![1, 2],
                    parent_block_hash: None,
                    token_ids: vec![5, 6, 7, 8],
                    block_size: 2,
                    lora_id: Some(3)
                },
                KvEvent::BlockRemoved {
                    block_hashes: vec![1]
                },
                KvEvent::AllBlocksCleared,
            ]
        );
        assert!(log.is_empty());
    }
}
