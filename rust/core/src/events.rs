//! KV events queued by the engine, in the shape of vLLM's `BlockStored` / `BlockRemoved` /
//! `AllBlocksCleared`. The queue is a flat log (records pointing into shared hash, token and
//! successor buffers) so that queueing an event allocates nothing once the buffers are warm.
//!
//! Successors. A log made to publish them ([`EventLog::set_successors`]) gives each
//! `BlockStored` the successor recorded with each of its blocks (the token after the block with
//! which its stored EAGLE draft KV was written, [`NO_SUCCESSOR`] for none); the encoder writes
//! them as vLLM 0.33's `lookahead_token_ids` (`[successor]` or `[]` per block). A log that does
//! not publish them leaves the field out, so its bytes are vLLM 0.32's.

use crate::cache::NO_SUCCESSOR;

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
        /// Per block of `block_hashes`: its recorded successor ([`NO_SUCCESSOR`]: none), written
        /// as vLLM 0.33's `lookahead_token_ids`; `None`: the field is absent (vLLM 0.32's layout).
        successors: Option<Vec<u32>>,
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
        /// See [`KvEvent::BlockStored`]'s `successors`.
        successors: Option<&'a [u32]>,
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
                successors,
            } => KvEventRef::BlockStored {
                block_hashes,
                parent_block_hash: *parent_block_hash,
                token_ids,
                block_size: *block_size,
                lora_id: *lora_id,
                successors: successors.as_deref(),
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
                successors,
            } => KvEvent::BlockStored {
                block_hashes: block_hashes.to_vec(),
                parent_block_hash,
                token_ids: token_ids.to_vec(),
                block_size,
                lora_id,
                successors: successors.map(<[u32]>::to_vec),
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
        /// Whether the event carries its blocks' successors.
        successors: bool,
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
    /// Per entry of `hashes`: the block's successor (BlockStored), [`NO_SUCCESSOR`] otherwise.
    succ: Vec<u32>,
    block_size: u32,
    /// Whether BlockStored events carry their successors.
    with_successors: bool,
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
        self.succ.clear();
    }
    /// Whether `BlockStored` events closed from now on carry their blocks' successors (vLLM
    /// 0.33's `lookahead_token_ids`). Off by default: the events are vLLM 0.32's.
    pub fn set_successors(&mut self, on: bool) {
        self.with_successors = on;
    }
    pub fn successors(&self) -> bool {
        self.with_successors
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
        self.push_stored_block_with_successor(hash, tokens, NO_SUCCESSOR);
    }
    /// [`EventLog::push_stored_block`] with the block's successor ([`NO_SUCCESSOR`]: none),
    /// published only by a log with [`EventLog::set_successors`] on.
    pub fn push_stored_block_with_successor(&mut self, hash: u64, tokens: &[u32], successor: u32) {
        self.hashes.push(hash);
        self.succ.push(successor);
        self.tokens.extend_from_slice(tokens);
    }
    pub fn finish_stored(&mut self, parent: Option<u64>, lora_id: Option<u64>) {
        let successors = self.with_successors;
        self.close(Kind::Stored {
            parent,
            lora_id,
            successors,
        });
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
        self.succ.resize(self.hashes.len(), NO_SUCCESSOR);
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
            let ss = &self.succ[h0..r.hashes_end];
            h0 = r.hashes_end;
            t0 = r.tokens_end;
            match r.kind {
                Kind::Stored {
                    parent,
                    lora_id,
                    successors,
                } => KvEventRef::BlockStored {
                    block_hashes: hs,
                    parent_block_hash: parent,
                    token_ids: ts,
                    block_size: self.block_size,
                    lora_id,
                    successors: successors.then_some(ss),
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
                    lora_id: Some(3),
                    successors: None,
                },
                KvEvent::BlockRemoved {
                    block_hashes: vec![1]
                },
                KvEvent::AllBlocksCleared,
            ]
        );
        assert!(log.is_empty());
    }

    #[test]
    fn successors_are_published_only_by_a_log_that_publishes_them() {
        let mut log = EventLog::new(1);
        log.push_stored_block_with_successor(1, &[5], 6);
        log.finish_stored(None, None);
        log.set_successors(true);
        assert!(log.successors());
        log.push_removed(&[7, 8]);
        log.push_stored_block_with_successor(2, &[6], 9);
        log.push_stored_block(3, &[9]);
        log.finish_stored(Some(1), None);
        log.push_cleared();
        log.push_stored_block_with_successor(4, &[1], 0);
        log.finish_stored(Some(3), Some(2));
        let stored = |h: Vec<u64>, p, t: Vec<u32>, l, s| KvEvent::BlockStored {
            block_hashes: h,
            parent_block_hash: p,
            token_ids: t,
            block_size: 1,
            lora_id: l,
            successors: s,
        };
        assert_eq!(
            log.drain(),
            vec![
                stored(vec![1], None, vec![5], None, None),
                KvEvent::BlockRemoved {
                    block_hashes: vec![7, 8]
                },
                stored(vec![2, 3], Some(1), vec![6, 9], None, Some(vec![9, NO_SUCCESSOR])),
                KvEvent::AllBlocksCleared,
                stored(vec![4], Some(3), vec![1], Some(2), Some(vec![0])),
            ]
        );
        // Warm buffers: queueing again allocates nothing.
        let caps = (log.hashes.capacity(), log.succ.capacity(), log.records.capacity());
        log.push_stored_block_with_successor(2, &[6], 9);
        log.finish_stored(None, None);
        log.push_removed(&[1]);
        assert_eq!(caps, (log.hashes.capacity(), log.succ.capacity(), log.records.capacity()));
    }
}
