//! Encoding the engine's queued events in vLLM's KV event wire format, straight from the event
//! log.
//!
//! vLLM publishes a `KVEventBatch` encoded by msgspec's msgpack encoder. The batch struct is
//! `array_like`, so it is the array `[ts, events, data_parallel_rank]`; msgspec writes all three
//! elements even when the rank is `None` (nil): `omit_defaults` does not shorten array-like
//! structs. Each event is a map tagged `"type": <class name>` first, then its fields in
//! declaration order; fields whose value equals their default are omitted, so the optional
//! trailing fields of `BlockStored`/`BlockRemoved` (all defaulting to `None`) never appear, while
//! `parent_block_hash`, `lora_id`, `medium` and `lora_name` (no default) are always written.
//!
//! vLLM 0.33 added a fifteenth field to `BlockStored`, `lookahead_token_ids` (last, default
//! `None`). An event with successors ([`KvEventRef::BlockStored`]'s `successors`) is written as
//! vLLM 0.33 writes it: msgspec sizes a struct's map header by its field count (tag included),
//! so every 0.33 `BlockStored` gets a map16 header (`0xde`, then the 16-bit count of the fields
//! written: 9), and `lookahead_token_ids` follows `lora_name` (the fields between are `None`,
//! their default, and omitted), one array per block: `[successor]`, or `[]` for
//! [`NO_SUCCESSOR`]. An event without successors keeps vLLM 0.32's bytes (a fixmap of 8); a
//! vLLM 0.32 decoder reads the 0.33 form too (msgspec skips a field its struct does not have).
//!
//! msgspec writes every integer in its smallest msgpack form (unsigned forms for non-negative
//! values), every Python float as float64, and strings/arrays/maps with the smallest header;
//! rmp's `write_uint`/`write_sint`/`write_f64`/`write_*_len` make the same choices, so the bytes
//! here equal msgspec's byte for byte (the Python tests check that on random batches).
//!
//! We write with `rmp` directly rather than through serde: the hash representation is chosen at
//! run time and the log is flat, so building serde values would only add copies. Token ids, the
//! bulk of a batch, go through `put_u32`, the same choice as `rmp::encode::write_uint` without
//! its per-call plumbing (about twice as fast end to end; a test checks it against rmp).

use std::convert::Infallible;

use rmp::encode::{self as enc, ByteBuf, ValueWriteError};
use thiserror::Error;

use crate::cache::NO_SUCCESSOR;
use crate::events::{EventLog, KvEvent, KvEventRef};

/// How block hashes go on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HashFormat {
    /// Unsigned 64-bit integers: vLLM's default external form (`ExternalBlockHash` as int).
    #[default]
    U64,
    /// 8-byte big-endian `bytes`, for consumers that key by raw hash bytes.
    Bytes,
}

/// The batch-level values that are not in the event log.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BatchMeta<'a> {
    /// Seconds since the epoch (written as float64, like a Python float).
    pub ts: f64,
    /// `None` is written as nil (vLLM's publisher normally fills in its rank).
    pub data_parallel_rank: Option<i64>,
    /// Storage tier of every event in the batch: vLLM uses "GPU"; kvslots' host tier is "CPU".
    pub medium: Option<&'a str>,
    pub hash_format: HashFormat,
}

impl<'a> BatchMeta<'a> {
    pub fn new(ts: f64) -> Self {
        BatchMeta {
            ts,
            data_parallel_rank: None,
            medium: None,
            hash_format: HashFormat::U64,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum EncodeError {
    /// msgpack headers carry 32-bit lengths.
    #[error(
        "{what} has {len} elements; msgpack allows at most {} per array or string",
        u32::MAX
    )]
    TooLong { what: &'static str, len: usize },
    /// A `BlockStored` whose successors do not match its blocks one for one.
    #[error("BlockStored has {hashes} block hashes but {successors} successors")]
    Successors { hashes: usize, successors: usize },
}

/// Appends the msgpack bytes of one `KVEventBatch` holding `events` to `out`. On error `out` is
/// left as it was.
pub fn encode_batch<'e, I>(
    events: I,
    meta: &BatchMeta<'_>,
    out: &mut Vec<u8>,
) -> Result<(), EncodeError>
where
    I: IntoIterator<Item = KvEventRef<'e>>,
    I::IntoIter: ExactSizeIterator,
{
    let start = out.len();
    let mut w = Writer {
        buf: ByteBuf::from(std::mem::take(out)),
        hash_format: meta.hash_format,
    };
    let result = w.batch(events.into_iter(), meta);
    *out = w.buf.into_vec();
    if result.is_err() {
        out.truncate(start);
    }
    result
}

/// [`encode_batch`] over owned events.
pub fn encode_owned(
    events: &[KvEvent],
    meta: &BatchMeta<'_>,
    out: &mut Vec<u8>,
) -> Result<(), EncodeError> {
    encode_batch(events.iter().map(KvEvent::as_ref), meta, out)
}

impl EventLog {
    /// Appends the queued events as one msgpack `KVEventBatch` to `out` (the log is unchanged).
    pub fn encode_msgpack(
        &self,
        meta: &BatchMeta<'_>,
        out: &mut Vec<u8>,
    ) -> Result<(), EncodeError> {
        encode_batch(self.iter(), meta, out)
    }
}

/// Appends each queued event's msgpack bytes to `out`, one after the other, and the end offset
/// of each in `out` to `ends`: the elements of a batch's `events` array exactly as
/// [`encode_batch`] writes them (`meta.ts` and `meta.data_parallel_rank` are not used). A
/// consumer that frames the batch itself (msgspec's `Raw`) gets vLLM's bytes without building
/// one object per field. On error `out` and `ends` are left as they were.
pub fn encode_each<'e, I>(
    events: I,
    meta: &BatchMeta<'_>,
    out: &mut Vec<u8>,
    ends: &mut Vec<usize>,
) -> Result<(), EncodeError>
where
    I: IntoIterator<Item = KvEventRef<'e>>,
{
    let (start, n_ends) = (out.len(), ends.len());
    let mut w = Writer {
        buf: ByteBuf::from(std::mem::take(out)),
        hash_format: meta.hash_format,
    };
    let mut result = Ok(());
    for ev in events {
        result = w.event(ev, meta.medium);
        if result.is_err() {
            break;
        }
        ends.push(w.buf.as_vec().len());
    }
    *out = w.buf.into_vec();
    if result.is_err() {
        out.truncate(start);
        ends.truncate(n_ends);
    }
    result
}

impl EventLog {
    /// [`encode_each`] over the queued events (the log is unchanged).
    pub fn encode_each(
        &self,
        meta: &BatchMeta<'_>,
        out: &mut Vec<u8>,
        ends: &mut Vec<usize>,
    ) -> Result<(), EncodeError> {
        encode_each(self.iter(), meta, out, ends)
    }
}

/// rmp's errors over `ByteBuf` are `Infallible`; this unwraps them without a panic path.
#[inline]
fn ok<T>(r: Result<T, ValueWriteError<Infallible>>) -> T {
    match r {
        Ok(v) => v,
        Err(ValueWriteError::InvalidMarkerWrite(e) | ValueWriteError::InvalidDataWrite(e)) => {
            match e {}
        }
    }
}

fn len32(what: &'static str, len: usize) -> Result<u32, EncodeError> {
    u32::try_from(len).map_err(|_| EncodeError::TooLong { what, len })
}

/// msgpack's smallest unsigned form of `x` (what `rmp::encode::write_uint` picks), without
/// rmp's per-call marker/Result plumbing: token ids are most of a batch's bytes.
#[inline]
fn put_u32(v: &mut Vec<u8>, x: u32) {
    if x < 0x80 {
        v.push(x as u8);
    } else if x < 0x100 {
        v.extend_from_slice(&[0xcc, x as u8]);
    } else if x < 0x1_0000 {
        let b = (x as u16).to_be_bytes();
        v.extend_from_slice(&[0xcd, b[0], b[1]]);
    } else {
        let b = x.to_be_bytes();
        v.extend_from_slice(&[0xce, b[0], b[1], b[2], b[3]]);
    }
}

struct Writer {
    buf: ByteBuf,
    hash_format: HashFormat,
}

impl Writer {
    fn batch<'e>(
        &mut self,
        events: impl ExactSizeIterator<Item = KvEventRef<'e>>,
        meta: &BatchMeta<'_>,
    ) -> Result<(), EncodeError> {
        ok(enc::write_array_len(&mut self.buf, 3));
        ok(enc::write_f64(&mut self.buf, meta.ts));
        ok(enc::write_array_len(
            &mut self.buf,
            len32("events", events.len())?,
        ));
        for ev in events {
            self.event(ev, meta.medium)?;
        }
        match meta.data_parallel_rank {
            Some(r) => {
                ok(enc::write_sint(&mut self.buf, r));
            }
            None => self.nil(),
        }
        Ok(())
    }

    fn event(&mut self, ev: KvEventRef<'_>, medium: Option<&str>) -> Result<(), EncodeError> {
        match ev {
            KvEventRef::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                lora_id,
                successors,
            } => {
                match successors {
                    None => {
                        ok(enc::write_map_len(&mut self.buf, 8));
                    }
                    Some(s) => {
                        if s.len() != block_hashes.len() {
                            return Err(EncodeError::Successors {
                                hashes: block_hashes.len(),
                                successors: s.len(),
                            });
                        }
                        // map16 with 9 entries, as msgspec writes vLLM 0.33's 16-key struct.
                        self.buf.as_mut_vec().extend_from_slice(&[0xde, 0x00, 0x09]);
                    }
                }
                self.str("type")?;
                self.str("BlockStored")?;
                self.str("block_hashes")?;
                self.hashes(block_hashes)?;
                self.str("parent_block_hash")?;
                match parent_block_hash {
                    Some(h) => self.hash(h),
                    None => self.nil(),
                }
                self.str("token_ids")?;
                ok(enc::write_array_len(
                    &mut self.buf,
                    len32("token_ids", token_ids.len())?,
                ));
                let v = self.buf.as_mut_vec();
                v.reserve(token_ids.len() * 5);
                for &t in token_ids {
                    put_u32(v, t);
                }
                self.str("block_size")?;
                ok(enc::write_uint(&mut self.buf, block_size as u64));
                self.str("lora_id")?;
                match lora_id {
                    Some(l) => {
                        ok(enc::write_uint(&mut self.buf, l));
                    }
                    None => self.nil(),
                }
                self.str("medium")?;
                self.opt_str(medium)?;
                // The core keys LoRA adapters by id only; the name is unknown here.
                self.str("lora_name")?;
                self.nil();
                if let Some(s) = successors {
                    self.str("lookahead_token_ids")?;
                    ok(enc::write_array_len(
                        &mut self.buf,
                        len32("lookahead_token_ids", s.len())?,
                    ));
                    let v = self.buf.as_mut_vec();
                    for &t in s {
                        if t == NO_SUCCESSOR {
                            v.push(0x90);
                        } else {
                            v.push(0x91);
                            put_u32(v, t);
                        }
                    }
                }
            }
            KvEventRef::BlockRemoved { block_hashes } => {
                ok(enc::write_map_len(&mut self.buf, 3));
                self.str("type")?;
                self.str("BlockRemoved")?;
                self.str("block_hashes")?;
                self.hashes(block_hashes)?;
                self.str("medium")?;
                self.opt_str(medium)?;
            }
            KvEventRef::AllBlocksCleared => {
                ok(enc::write_map_len(&mut self.buf, 1));
                self.str("type")?;
                self.str("AllBlocksCleared")?;
            }
        }
        Ok(())
    }

    fn nil(&mut self) {
        ok(enc::write_nil(&mut self.buf).map_err(ValueWriteError::InvalidMarkerWrite));
    }

    fn str(&mut self, s: &str) -> Result<(), EncodeError> {
        ok(enc::write_str_len(&mut self.buf, len32("string", s.len())?));
        self.buf.as_mut_vec().extend_from_slice(s.as_bytes());
        Ok(())
    }

    fn opt_str(&mut self, s: Option<&str>) -> Result<(), EncodeError> {
        match s {
            Some(s) => self.str(s),
            None => {
                self.nil();
                Ok(())
            }
        }
    }

    fn hashes(&mut self, hashes: &[u64]) -> Result<(), EncodeError> {
        ok(enc::write_array_len(
            &mut self.buf,
            len32("block_hashes", hashes.len())?,
        ));
        for &h in hashes {
            self.hash(h);
        }
        Ok(())
    }

    fn hash(&mut self, h: u64) {
        match self.hash_format {
            HashFormat::U64 => {
                ok(enc::write_uint(&mut self.buf, h));
            }
            HashFormat::Bytes => {
                ok(enc::write_bin_len(&mut self.buf, 8));
                self.buf.as_mut_vec().extend_from_slice(&h.to_be_bytes());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    fn sample() -> Vec<KvEvent> {
        vec![
            KvEvent::BlockStored {
                block_hashes: vec![1, u64::MAX],
                parent_block_hash: None,
                token_ids: vec![1, 2],
                block_size: 2,
                lora_id: None,
                successors: None,
            },
            KvEvent::BlockRemoved {
                block_hashes: vec![5],
            },
            KvEvent::AllBlocksCleared,
        ]
    }

    // Golden bytes from msgspec 0.22 encoding kvslots.events (= vLLM 0.32) structs.
    #[test]
    fn matches_msgspec_golden_bytes() {
        // KVEventBatch(1.5, [BlockStored([1, 2**64-1], None, [1, 2], 2, None, "CPU", None),
        //                    BlockRemoved([5], "CPU"), AllBlocksCleared()])
        let mut meta = BatchMeta::new(1.5);
        meta.medium = Some("CPU");
        let mut out = Vec::new();
        encode_owned(&sample(), &meta, &mut out).unwrap();
        assert_eq!(out, hex("93cb3ff80000000000009388a474797065ab426c6f636b53746f726564ac626c6f636b5f6861736865739201cfffffffffffffffffb1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473920102aa626c6f636b5f73697a6502a76c6f72615f6964c0a66d656469756da3435055a96c6f72615f6e616d65c083a474797065ac426c6f636b52656d6f766564ac626c6f636b5f6861736865739105a66d656469756da343505581a474797065b0416c6c426c6f636b73436c6561726564c0"));

        // KVEventBatch(1.5, [BlockRemoved([5], None), AllBlocksCleared()], 0)
        let mut meta = BatchMeta::new(1.5);
        meta.data_parallel_rank = Some(0);
        let mut out = Vec::new();
        encode_owned(&sample()[1..], &meta, &mut out).unwrap();
        assert_eq!(out, hex("93cb3ff80000000000009283a474797065ac426c6f636b52656d6f766564ac626c6f636b5f6861736865739105a66d656469756dc081a474797065b0416c6c426c6f636b73436c656172656400"));
    }

    #[test]
    fn each_event_is_its_span_of_the_batch() {
        let events = sample();
        for hf in [HashFormat::U64, HashFormat::Bytes] {
            let meta = BatchMeta {
                ts: 1.5,
                data_parallel_rank: Some(3),
                medium: Some("CPU"),
                hash_format: hf,
            };
            let mut batch = Vec::new();
            encode_owned(&events, &meta, &mut batch).unwrap();
            let (mut each, mut ends) = (vec![0xAA], vec![7]);
            encode_each(
                events.iter().map(KvEvent::as_ref),
                &meta,
                &mut each,
                &mut ends,
            )
            .unwrap();
            assert_eq!(ends.len(), events.len() + 1);
            // The batch is [ts, [events...], rank]: its events array body is the spans, in order.
            let header = 1 + 9 + 1; // fixarray(3), float64, fixarray(n)
            let body = &batch[header..batch.len() - 1];
            assert_eq!(&each[1..], body);
            assert_eq!(*ends.last().unwrap(), each.len());
            assert!(ends[1..].windows(2).all(|w| w[0] < w[1]) && ends[1] > 1);
        }
    }

    #[test]
    fn empty_batch_and_ranks() {
        let mut out = Vec::new();
        encode_owned(&[], &BatchMeta::new(1.0), &mut out).unwrap();
        assert_eq!(out, hex("93cb3ff000000000000090c0"));
        for (rank, tail) in [
            (3, "03"),
            (-1, "ff"),
            (-33, "d0df"),
            (200, "ccc8"),
            (70000, "ce00011170"),
        ] {
            let mut meta = BatchMeta::new(1.0);
            meta.data_parallel_rank = Some(rank);
            let mut out = Vec::new();
            encode_owned(&[], &meta, &mut out).unwrap();
            assert_eq!(
                out,
                hex(&format!("93cb3ff000000000000090{tail}")),
                "rank {rank}"
            );
        }
    }

    #[test]
    fn bytes_hashes_and_lora() {
        let ev = [KvEvent::BlockStored {
            block_hashes: vec![0],
            parent_block_hash: Some(0x0101_0101_0101_0101),
            token_ids: vec![],
            block_size: 2,
            lora_id: Some(3),
            successors: None,
        }];
        let mut meta = BatchMeta::new(0.0);
        meta.hash_format = HashFormat::Bytes;
        let mut out = Vec::new();
        encode_owned(&ev, &meta, &mut out).unwrap();
        // msgspec: BlockStored([b"\0"*8], b"\1"*8, [], 2, 3, None, None)
        let map = "88a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657391c4080000000000000000b1706172656e745f626c6f636b5f68617368c4080101010101010101a9746f6b656e5f69647390aa626c6f636b5f73697a6502a76c6f72615f696403a66d656469756dc0a96c6f72615f6e616d65c0";
        assert_eq!(out, hex(&format!("93cb000000000000000091{map}c0")));
    }

    #[test]
    fn log_encodes_like_owned_events() {
        let mut log = EventLog::new(2);
        log.push_stored_block(1, &[1, 2]);
        log.push_stored_block(u64::MAX, &[3, 4]);
        log.finish_stored(Some(9), Some(300));
        log.push_removed(&[1, 2, 3]);
        log.push_cleared();
        let meta = BatchMeta {
            ts: 12345.678,
            data_parallel_rank: Some(1),
            medium: Some("CPU"),
            hash_format: HashFormat::U64,
        };
        let (mut a, mut b) = (vec![0xAA], Vec::new());
        log.encode_msgpack(&meta, &mut a).unwrap();
        encode_owned(&log.drain(), &meta, &mut b).unwrap();
        assert_eq!(a[0], 0xAA, "appends, keeps what was there");
        assert_eq!(a[1..], b[..]);
    }

    fn stored_with(successors: Option<Vec<u32>>) -> KvEvent {
        KvEvent::BlockStored {
            block_hashes: vec![1, u64::MAX],
            parent_block_hash: Some(9),
            token_ids: vec![1, 2, 3, 4],
            block_size: 2,
            lora_id: Some(7),
            successors,
        }
    }

    // Golden bytes from vLLM 0.33's own structs encoded by msgspec 0.22.
    #[test]
    fn successors_match_vllm_033_golden_bytes() {
        // KVEventBatch(1.5, [BlockStored([1, 2**64-1], 9, [1, 2, 3, 4], 2, 7, "CPU", None,
        //     lookahead_token_ids=[[300], []]), BlockRemoved([5], "CPU")], data_parallel_rank=0)
        let events = [
            stored_with(Some(vec![300, NO_SUCCESSOR])),
            KvEvent::BlockRemoved {
                block_hashes: vec![5],
            },
        ];
        let meta = BatchMeta {
            ts: 1.5,
            data_parallel_rank: Some(0),
            medium: Some("CPU"),
            hash_format: HashFormat::U64,
        };
        let mut out = Vec::new();
        encode_owned(&events, &meta, &mut out).unwrap();
        assert_eq!(out, hex("93cb3ff800000000000092de0009a474797065ab426c6f636b53746f726564ac626c6f636b5f6861736865739201cfffffffffffffffffb1706172656e745f626c6f636b5f6861736809a9746f6b656e5f6964739401020304aa626c6f636b5f73697a6502a76c6f72615f696407a66d656469756da3435055a96c6f72615f6e616d65c0b36c6f6f6b61686561645f746f6b656e5f6964739291cd012c9083a474797065ac426c6f636b52656d6f766564ac626c6f636b5f6861736865739105a66d656469756da343505500"));

        // KVEventBatch(0.0, [BlockStored([b"\0"*8], None, [70000], 1, None, "STORAGE", None,
        //     lookahead_token_ids=[[2**32-2]])])
        let events = [KvEvent::BlockStored {
            block_hashes: vec![0],
            parent_block_hash: None,
            token_ids: vec![70000],
            block_size: 1,
            lora_id: None,
            successors: Some(vec![u32::MAX - 1]),
        }];
        let meta = BatchMeta {
            ts: 0.0,
            data_parallel_rank: None,
            medium: Some("STORAGE"),
            hash_format: HashFormat::Bytes,
        };
        let mut out = Vec::new();
        encode_owned(&events, &meta, &mut out).unwrap();
        assert_eq!(out, hex("93cb000000000000000091de0009a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657391c4080000000000000000b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f69647391ce00011170aa626c6f636b5f73697a6501a76c6f72615f6964c0a66d656469756da753544f52414745a96c6f72615f6e616d65c0b36c6f6f6b61686561645f746f6b656e5f6964739191cefffffffec0"));
    }

    /// What a msgpack decoder (rmp-serde) reads back from one encoded BlockStored.
    #[derive(serde::Deserialize, Debug, PartialEq)]
    struct Decoded {
        #[serde(rename = "type")]
        kind: String,
        block_hashes: Vec<u64>,
        parent_block_hash: Option<u64>,
        token_ids: Vec<u32>,
        block_size: u32,
        lora_id: Option<u64>,
        medium: Option<String>,
        lora_name: Option<String>,
        lookahead_token_ids: Option<Vec<Vec<u32>>>,
    }

    #[test]
    fn successors_decode_as_lookahead_token_ids_and_none_keeps_the_032_layout() {
        let meta = BatchMeta {
            ts: 0.0,
            data_parallel_rank: None,
            medium: Some("CPU"),
            hash_format: HashFormat::U64,
        };
        let encode = |ev: KvEvent| {
            let (mut out, mut ends) = (Vec::new(), Vec::new());
            encode_each([ev.as_ref()], &meta, &mut out, &mut ends).unwrap();
            assert_eq!(ends, vec![out.len()]);
            out
        };
        let with = encode(stored_with(Some(vec![0, NO_SUCCESSOR])));
        let without = encode(stored_with(None));
        assert_eq!(&with[..3], &[0xde, 0x00, 0x09]);
        assert_eq!(without[0], 0x88, "fixmap of 8: vLLM 0.32's bytes");
        // The same fields, then lookahead_token_ids appended.
        assert_eq!(with[3..without.len() + 2], without[1..]);
        let d: Decoded = rmp_serde::from_slice(&with).unwrap();
        assert_eq!(d.lookahead_token_ids, Some(vec![vec![0], vec![]]));
        assert_eq!(
            (d.kind.as_str(), d.block_hashes, d.parent_block_hash, d.token_ids),
            ("BlockStored", vec![1, u64::MAX], Some(9), vec![1, 2, 3, 4])
        );
        assert_eq!((d.block_size, d.lora_id, d.medium.as_deref(), d.lora_name), (2, Some(7), Some("CPU"), None));
        let d: Decoded = rmp_serde::from_slice(&without).unwrap();
        assert_eq!(d.lookahead_token_ids, None);
        // Every token size class of a successor round-trips.
        let succ = vec![0, 127, 128, 255, 256, 65535, 65536, u32::MAX - 1];
        let ev = KvEvent::BlockStored {
            block_hashes: (0..succ.len() as u64).collect(),
            parent_block_hash: None,
            token_ids: vec![0; succ.len()],
            block_size: 1,
            lora_id: None,
            successors: Some(succ.clone()),
        };
        let d: Decoded = rmp_serde::from_slice(&encode(ev)).unwrap();
        let want: Vec<Vec<u32>> = succ.iter().map(|&s| vec![s]).collect();
        assert_eq!(d.lookahead_token_ids, Some(want));
    }

    #[test]
    fn log_with_successors_encodes_like_owned_events_and_mismatch_is_an_error() {
        let mut log = EventLog::new(2);
        log.set_successors(true);
        log.push_stored_block_with_successor(1, &[1, 2], 3);
        log.push_stored_block(u64::MAX, &[3, 4]);
        log.finish_stored(Some(9), Some(7));
        log.push_removed(&[1]);
        let meta = BatchMeta {
            ts: 2.5,
            data_parallel_rank: Some(1),
            medium: Some("CPU"),
            hash_format: HashFormat::U64,
        };
        let (mut a, mut b) = (Vec::new(), Vec::new());
        log.encode_msgpack(&meta, &mut a).unwrap();
        let owned = log.drain();
        assert_eq!(owned[0], stored_with(Some(vec![3, NO_SUCCESSOR])));
        encode_owned(&owned, &meta, &mut b).unwrap();
        assert_eq!(a, b);

        let bad = [stored_with(Some(vec![3]))];
        let mut out = vec![0xAA];
        assert_eq!(
            encode_owned(&bad, &meta, &mut out),
            Err(EncodeError::Successors {
                hashes: 2,
                successors: 1
            })
        );
        assert_eq!(out, vec![0xAA], "left as it was");
        let (mut out, mut ends) = (vec![0xAA], vec![1]);
        assert!(encode_each(bad.iter().map(KvEvent::as_ref), &meta, &mut out, &mut ends).is_err());
        assert_eq!((out, ends), (vec![0xAA], vec![1]));
    }

    #[test]
    fn fast_token_ints_equal_rmp() {
        let edges = [
            0u32,
            1,
            127,
            128,
            255,
            256,
            65535,
            65536,
            16_777_216,
            u32::MAX - 1,
            u32::MAX,
        ];
        for x in edges.into_iter().chain((0..5000).map(|i| i * 997)) {
            let (mut a, mut b) = (Vec::new(), ByteBuf::new());
            put_u32(&mut a, x);
            ok(enc::write_uint(&mut b, x as u64));
            assert_eq!(a, b.into_vec(), "{x}");
        }
    }

    #[test]
    fn length_limit_is_an_error_not_a_panic() {
        assert_eq!(len32("x", u32::MAX as usize), Ok(u32::MAX));
        assert_eq!(
            len32("token_ids", u32::MAX as usize + 1),
            Err(EncodeError::TooLong {
                what: "token_ids",
                len: u32::MAX as usize + 1
            })
        );
    }
}
