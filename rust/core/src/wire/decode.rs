//! Decoding vLLM's KV event batches (msgpack) straight into flat buffers, for the prefix
//! [`index`](crate::index).
//!
//! A batch is the msgpack array `[ts, events, data_parallel_rank?]`; each event is a map tagged by
//! `"type"` (vLLM >= 0.10) or, from older vLLMs, a positional array whose first element is the tag.
//! Decoding appends to reusable vectors, so a warm decoder allocates nothing per event.
//!
//! This reads msgpack markers directly (`rmp::Marker`) instead of going through serde: token lists
//! are most of every payload, and a per-element serde visit cost as much as everything else the
//! index does per block.
//!
//! Errors come in two kinds. A payload that is not msgpack, or not shaped like a batch, is a
//! [`DecodeError`] and nothing of it is applied. An event with a field of the wrong type is
//! decoded as far as it goes and marked `invalid`; the index skips it and applies the rest.
//!
//! Block hashes are accepted as unsigned or signed ints and as bytes; bytes become vLLM's int form
//! (`maybe_convert_block_hash`): the low 64 bits read big-endian.
//!
//! vLLM 0.33's `lookahead_token_ids` (one token list per block: the tokens after the block that
//! its hash also covers) is read into [`Lookahead`] records, one per block; events without it
//! (every 0.32 event) have none.

use std::fmt;
use std::ops::Range;

use rmp::Marker;
use xxhash_rust::xxh3::xxh3_64;

use crate::index::Tier;

/// Which kind of event a record is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WireKind {
    Stored,
    Removed,
    Cleared,
    /// A tag this decoder does not know (a newer vLLM): skipped by the index, counted.
    Unknown,
}

/// The `medium` field as sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WireMedium {
    /// Absent or nil: the stream's default tier.
    Default,
    Named(Tier),
    /// A medium name the index has no tier for.
    Unknown,
}

/// One decoded event; ranges point into [`DecodedBatch`]'s flat buffers.
#[derive(Debug, Clone)]
pub struct WireEvent {
    pub kind: WireKind,
    pub medium: WireMedium,
    pub hashes: Range<usize>,
    pub tokens: Range<usize>,
    /// Per-block extra-key hashes (`extra_keys`), empty when the event has none.
    pub extras: Range<usize>,
    /// Per-block lookahead tokens (`lookahead_token_ids`, vLLM 0.33), empty when the event has
    /// none.
    pub lookahead: Range<usize>,
    pub parent: Option<u64>,
    pub block_size: u64,
    /// LoRA identity for the key chain: `lora_id`, else a hash of `lora_name`.
    pub lora: Option<u64>,
    pub group: u64,
    /// Why the event is skipped: a field had the wrong type or range.
    pub invalid: Option<&'static str>,
}

/// A decoded batch. Reused across calls: `decode` clears it first.
#[derive(Debug, Default, Clone)]
pub struct DecodedBatch {
    pub events: Vec<WireEvent>,
    pub hashes: Vec<u64>,
    pub tokens: Vec<u32>,
    pub extras: Vec<Option<u64>>,
    pub lookahead: Vec<Lookahead>,
    pub ts: f64,
    pub dp_rank: Option<i64>,
    // One event's extra keys until its lora_name is known (fields may come in any order).
    extra_scratch: Vec<Option<TupleHash>>,
    lookahead_scratch: Vec<u32>,
}

/// The tokens after one block that its hash covers: how many, and a hash of them
/// ([`lookahead_hash`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lookahead {
    pub len: u32,
    pub hash: u64,
    /// The first of those tokens (meaningful when `len >= 1`): on a host or disk tier it is
    /// the block's recorded successor (see [`crate::index`]).
    pub first: u32,
}

/// The hash of a block's lookahead tokens, as the index keys them (also computed from a
/// prompt's tokens at lookup).
pub fn lookahead_hash(tokens: &[u32]) -> u64 {
    let mut h = xxhash_rust::xxh3::Xxh3::with_seed(0x4C4F_4F4B_4148_4541); // "LOOKAHEA"
    for t in tokens {
        h.update(&t.to_le_bytes());
    }
    h.digest() ^ tokens.len() as u64
}

/// Hashes of one `extra_keys` entry: of the whole tuple, and of the tuple without its first
/// element (vLLM puts the LoRA name first; the LoRA is already part of the key on its own).
#[derive(Debug, Clone, Copy)]
struct TupleHash {
    full: u64,
    rest: Option<u64>,
    first_str: Option<u64>,
}

/// A payload that is not a KV event batch at all (not msgpack, wrong shape, truncated).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeError(pub String);

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Hash of a LoRA name, as used when an event (or a lookup) names its LoRA but gives no id.
pub fn lora_name_key(name: &str) -> u64 {
    xxh3_64(name.as_bytes())
}

/// vLLM's int form of a bytes hash: the low 64 bits, big-endian.
pub fn bytes_hash(v: &[u8]) -> u64 {
    let tail = &v[v.len().saturating_sub(8)..];
    tail.iter().fold(0u64, |acc, &b| (acc << 8) | u64::from(b))
}

impl DecodedBatch {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn clear(&mut self) {
        self.events.clear();
        self.hashes.clear();
        self.tokens.clear();
        self.extras.clear();
        self.lookahead.clear();
        self.ts = 0.0;
        self.dp_rank = None;
    }

    /// Decodes one payload. On error the batch is left cleared (nothing half-decoded leaks out).
    pub fn decode(&mut self, payload: &[u8]) -> Result<(), DecodeError> {
        self.clear();
        let mut r = Rd { b: payload, p: 0 };
        match self.batch(&mut r) {
            Ok(()) if r.p == payload.len() => Ok(()),
            Ok(()) => {
                self.clear();
                Err(DecodeError(format!(
                    "malformed KV event batch: {} trailing bytes",
                    payload.len() - r.p
                )))
            }
            Err(e) => {
                self.clear();
                Err(DecodeError(format!(
                    "malformed KV event batch at byte {}: {e}",
                    r.p
                )))
            }
        }
    }

    pub fn event_hashes(&self, ev: &WireEvent) -> &[u64] {
        &self.hashes[ev.hashes.clone()]
    }
    pub fn event_tokens(&self, ev: &WireEvent) -> &[u32] {
        &self.tokens[ev.tokens.clone()]
    }
    pub fn event_extras(&self, ev: &WireEvent) -> &[Option<u64>] {
        &self.extras[ev.extras.clone()]
    }
    pub fn event_lookahead(&self, ev: &WireEvent) -> &[Lookahead] {
        &self.lookahead[ev.lookahead.clone()]
    }

    fn batch(&mut self, r: &mut Rd<'_>) -> Res<()> {
        let n = match r.head()? {
            Val::Array(n) if n >= 2 => n,
            _ => return Err("expected an array [ts, events, data_parallel_rank]"),
        };
        self.ts = match r.head()? {
            Val::F(v) => v,
            Val::Uint(v) => v as f64,
            Val::Int(v) => v as f64,
            _ => return Err("ts must be a number"),
        };
        let m = match r.head()? {
            Val::Array(m) => m,
            _ => return Err("events must be a list"),
        };
        for _ in 0..m {
            self.event(r)?;
        }
        if n >= 3 {
            self.dp_rank = match r.head()? {
                Val::Uint(v) => i64::try_from(v).ok(),
                Val::Int(v) => Some(v),
                Val::Nil => None,
                _ => return Err("data_parallel_rank must be an int or nil"),
            };
        }
        for _ in 3..n {
            r.skip()?;
        }
        Ok(())
    }

    fn event(&mut self, r: &mut Rd<'_>) -> Res<()> {
        let n = self.hashes.len();
        let t = self.tokens.len();
        let mut p = Partial {
            ev: WireEvent {
                kind: WireKind::Unknown,
                medium: WireMedium::Default,
                hashes: n..n,
                tokens: t..t,
                extras: 0..0,
                lookahead: 0..0,
                parent: None,
                block_size: 0,
                lora: None,
                group: 0,
                invalid: None,
            },
            lora_id: None,
            lora_name: None,
            extras_start: self.extras.len(),
            has_extras: false,
        };
        self.extra_scratch.clear();
        match r.head()? {
            Val::Map(m) => {
                for _ in 0..m {
                    let field = match r.head()? {
                        Val::Str(s) => field_of(s),
                        _ => {
                            r.skip()?;
                            Field::Other
                        }
                    };
                    self.field(r, &mut p, field)?;
                }
            }
            Val::Array(m) if m >= 1 => {
                // Older vLLMs: ["BlockStored", hashes, parent, tokens, ...] positionally.
                self.field(r, &mut p, Field::Type)?;
                let order: &[Field] = match p.ev.kind {
                    WireKind::Stored => &STORED_ORDER,
                    WireKind::Removed => &REMOVED_ORDER,
                    _ => &[],
                };
                for i in 1..m as usize {
                    self.field(r, &mut p, order.get(i - 1).copied().unwrap_or(Field::Other))?;
                }
            }
            _ => return Err("an event must be a map or an array"),
        }
        self.finish(p);
        Ok(())
    }

    fn field(&mut self, r: &mut Rd<'_>, p: &mut Partial, field: Field) -> Res<()> {
        match field {
            Field::Type => {
                p.ev.kind = match r.head()? {
                    Val::Str(tag) => kind_of(tag),
                    v => {
                        r.skip_rest(v)?;
                        WireKind::Unknown
                    }
                }
            }
            Field::BlockHashes => {
                let start = self.hashes.len();
                match r.head()? {
                    Val::Array(m) => {
                        for _ in 0..m {
                            match r.head()? {
                                Val::Uint(h) => self.hashes.push(h),
                                // Two's complement: the 64 bits Python's `& (2**64 - 1)` keeps.
                                Val::Int(h) => self.hashes.push(h as u64),
                                Val::Bin(b) => self.hashes.push(bytes_hash(b)),
                                v => {
                                    r.skip_rest(v)?;
                                    p.bad("block_hashes must be a list of ints or bytes");
                                }
                            }
                        }
                    }
                    v => {
                        r.skip_rest(v)?;
                        p.bad("block_hashes must be a list");
                    }
                }
                p.ev.hashes = start..self.hashes.len();
            }
            Field::Parent => {
                p.ev.parent = match r.head()? {
                    Val::Nil => None,
                    Val::Uint(h) => Some(h),
                    Val::Int(h) => Some(h as u64),
                    Val::Bin(b) => Some(bytes_hash(b)),
                    v => {
                        r.skip_rest(v)?;
                        p.bad("parent_block_hash must be an int, bytes or nil");
                        None
                    }
                }
            }
            Field::TokenIds => {
                let start = self.tokens.len();
                match r.head()? {
                    Val::Array(m) => {
                        if !r.tokens(m, &mut self.tokens)? {
                            p.bad("token_ids must be a list of u32 token ids");
                        }
                    }
                    v => {
                        r.skip_rest(v)?;
                        p.bad("token_ids must be a list");
                    }
                }
                p.ev.tokens = start..self.tokens.len();
            }
            Field::BlockSize => match r.uint_or_nil()? {
                Some(Some(v)) => p.ev.block_size = v,
                _ => p.bad("block_size must be a non-negative int"),
            },
            Field::LoraId => match r.uint_or_nil()? {
                Some(v) => p.lora_id = v,
                None => p.bad("lora_id must be a non-negative int or nil"),
            },
            Field::GroupIdx => match r.uint_or_nil()? {
                Some(v) => p.ev.group = v.unwrap_or(0),
                None => p.bad("group_idx must be a non-negative int or nil"),
            },
            Field::Medium => {
                p.ev.medium = match r.head()? {
                    Val::Nil => WireMedium::Default,
                    Val::Str(s) => std::str::from_utf8(s)
                        .ok()
                        .and_then(Tier::parse)
                        .map_or(WireMedium::Unknown, WireMedium::Named),
                    v => {
                        r.skip_rest(v)?;
                        WireMedium::Unknown
                    }
                }
            }
            Field::LoraName => {
                p.lora_name = match r.head()? {
                    Val::Nil => None,
                    Val::Str(s) => Some(xxh3_64(s)),
                    v => {
                        r.skip_rest(v)?;
                        p.bad("lora_name must be a string or nil");
                        None
                    }
                }
            }
            Field::ExtraKeys => match r.head()? {
                Val::Nil => {}
                Val::Array(m) => {
                    p.has_extras = true;
                    for _ in 0..m {
                        let e = r.tuple_hash()?;
                        self.extra_scratch.push(e);
                    }
                }
                v => {
                    r.skip_rest(v)?;
                    p.bad("extra_keys must be a list or nil");
                }
            },
            Field::LookaheadTokenIds => {
                let start = self.lookahead.len();
                match r.head()? {
                    Val::Nil => {}
                    Val::Array(m) => {
                        for _ in 0..m {
                            match r.head()? {
                                Val::Array(k) => {
                                    self.lookahead_scratch.clear();
                                    if !r.tokens(k, &mut self.lookahead_scratch)? {
                                        p.bad(
                                            "lookahead_token_ids must hold lists of u32 token ids",
                                        );
                                    }
                                    let toks = &self.lookahead_scratch;
                                    self.lookahead.push(Lookahead {
                                        len: toks.len() as u32,
                                        hash: lookahead_hash(toks),
                                        first: toks.first().copied().unwrap_or(0),
                                    });
                                }
                                v => {
                                    r.skip_rest(v)?;
                                    p.bad("lookahead_token_ids must be a list of lists");
                                }
                            }
                        }
                    }
                    v => {
                        r.skip_rest(v)?;
                        p.bad("lookahead_token_ids must be a list of lists or nil");
                    }
                }
                p.ev.lookahead = start..self.lookahead.len();
            }
            Field::Other => r.skip()?,
        }
        Ok(())
    }

    fn finish(&mut self, mut p: Partial) {
        p.ev.lora = p.lora_id.or(p.lora_name);
        if p.has_extras && self.extra_scratch.iter().any(Option::is_some) {
            for e in &self.extra_scratch {
                let h = e.and_then(|t| match (t.first_str, p.lora_name) {
                    // vLLM lists the LoRA name first; it is already in the key via `lora`.
                    (Some(f), Some(name)) if f == name => t.rest,
                    _ => Some(t.full),
                });
                self.extras.push(h);
            }
        }
        p.ev.extras = p.extras_start..self.extras.len();
        self.events.push(p.ev);
    }
}

/// One event while its fields arrive.
struct Partial {
    ev: WireEvent,
    lora_id: Option<u64>,
    lora_name: Option<u64>,
    extras_start: usize,
    has_extras: bool,
}

impl Partial {
    fn bad(&mut self, why: &'static str) {
        self.ev.invalid.get_or_insert(why);
    }
}

/// The fields the index reads; the rest are skipped.
#[derive(Clone, Copy)]
enum Field {
    Type,
    BlockHashes,
    Parent,
    TokenIds,
    BlockSize,
    LoraId,
    Medium,
    LoraName,
    ExtraKeys,
    GroupIdx,
    LookaheadTokenIds,
    Other,
}

fn field_of(name: &[u8]) -> Field {
    // On length first, then one fixed-size compare (inline integer compares, not a memcmp
    // call): field names are read for every field of every event.
    fn is<const N: usize>(name: &[u8], lit: &[u8; N]) -> bool {
        <[u8; N]>::try_from(name).is_ok_and(|a| a == *lit)
    }
    match name.len() {
        4 if is(name, b"type") => Field::Type,
        6 if is(name, b"medium") => Field::Medium,
        7 if is(name, b"lora_id") => Field::LoraId,
        9 if is(name, b"token_ids") => Field::TokenIds,
        9 if is(name, b"lora_name") => Field::LoraName,
        9 if is(name, b"group_idx") => Field::GroupIdx,
        10 if is(name, b"block_size") => Field::BlockSize,
        10 if is(name, b"extra_keys") => Field::ExtraKeys,
        12 if is(name, b"block_hashes") => Field::BlockHashes,
        17 if is(name, b"parent_block_hash") => Field::Parent,
        19 if is(name, b"lookahead_token_ids") => Field::LookaheadTokenIds,
        _ => Field::Other,
    }
}

/// The event type tag, compared like field names.
fn kind_of(tag: &[u8]) -> WireKind {
    fn is<const N: usize>(name: &[u8], lit: &[u8; N]) -> bool {
        <[u8; N]>::try_from(name).is_ok_and(|a| a == *lit)
    }
    if is(tag, b"BlockStored") {
        WireKind::Stored
    } else if is(tag, b"BlockRemoved") {
        WireKind::Removed
    } else if is(tag, b"AllBlocksCleared") {
        WireKind::Cleared
    } else {
        WireKind::Unknown
    }
}

/// Positional field order of array-encoded events (after the tag), as in vLLM's structs.
const STORED_ORDER: [Field; 15] = [
    Field::BlockHashes,
    Field::Parent,
    Field::TokenIds,
    Field::BlockSize,
    Field::LoraId,
    Field::Medium,
    Field::LoraName,
    Field::ExtraKeys,
    Field::GroupIdx,
    Field::Other, // kv_cache_spec_kind
    Field::Other, // kv_cache_spec_sliding_window
    Field::Other, // locality
    Field::Other, // ownership
    Field::Other, // session_id
    Field::LookaheadTokenIds,
];
const REMOVED_ORDER: [Field; 3] = [Field::BlockHashes, Field::Medium, Field::GroupIdx];

type Res<T> = Result<T, &'static str>;

/// Nesting deeper than this is refused: skipping is recursive, and a hostile payload must not
/// be able to exhaust the stack.
const MAX_DEPTH: u32 = 32;

/// A scalar, or the header of a container (whose elements follow).
#[derive(Debug, Clone, Copy)]
enum Val<'a> {
    Nil,
    Bool,
    Uint(u64),
    Int(i64),
    F(f64),
    Str(&'a [u8]),
    Bin(&'a [u8]),
    Ext,
    Array(u32),
    Map(u32),
}

struct Rd<'a> {
    b: &'a [u8],
    p: usize,
}

impl<'a> Rd<'a> {
    #[inline]
    fn byte(&mut self) -> Res<u8> {
        let v = *self.b.get(self.p).ok_or("truncated")?;
        self.p += 1;
        Ok(v)
    }

    #[inline]
    fn take(&mut self, n: usize) -> Res<&'a [u8]> {
        let end = self.p.checked_add(n).ok_or("truncated")?;
        let s = self.b.get(self.p..end).ok_or("truncated")?;
        self.p = end;
        Ok(s)
    }

    #[inline]
    fn be<const N: usize>(&mut self) -> Res<[u8; N]> {
        let s = self.take(N)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn len8(&mut self) -> Res<usize> {
        Ok(usize::from(self.byte()?))
    }
    fn len16(&mut self) -> Res<usize> {
        Ok(usize::from(u16::from_be_bytes(self.be()?)))
    }
    fn len32(&mut self) -> Res<usize> {
        usize::try_from(u32::from_be_bytes(self.be()?)).map_err(|_| "length overflow")
    }

    /// Reads one scalar, or a container header.
    #[inline]
    fn head(&mut self) -> Res<Val<'a>> {
        let b = self.byte()?;
        // The markers of nearly every value in an event batch, ahead of the general decode.
        match b {
            0x00..=0x7f => return Ok(Val::Uint(u64::from(b))),
            0xa0..=0xbf => return Ok(Val::Str(self.take(usize::from(b & 0x1f))?)),
            0x90..=0x9f => return Ok(Val::Array(u32::from(b & 0x0f))),
            0x80..=0x8f => return Ok(Val::Map(u32::from(b & 0x0f))),
            0xc0 => return Ok(Val::Nil),
            0xcf => return Ok(Val::Uint(u64::from_be_bytes(self.be()?))),
            _ => {}
        }
        self.head_slow(b)
    }

    fn head_slow(&mut self, b: u8) -> Res<Val<'a>> {
        let m = Marker::from_u8(b);
        Ok(match m {
            Marker::FixPos(v) => Val::Uint(u64::from(v)),
            Marker::FixNeg(v) => Val::Int(i64::from(v)),
            Marker::Null => Val::Nil,
            Marker::True | Marker::False => Val::Bool,
            Marker::U8 => Val::Uint(u64::from(self.byte()?)),
            Marker::U16 => Val::Uint(u64::from(u16::from_be_bytes(self.be()?))),
            Marker::U32 => Val::Uint(u64::from(u32::from_be_bytes(self.be()?))),
            Marker::U64 => Val::Uint(u64::from_be_bytes(self.be()?)),
            Marker::I8 => Val::Int(i64::from(i8::from_be_bytes(self.be()?))),
            Marker::I16 => Val::Int(i64::from(i16::from_be_bytes(self.be()?))),
            Marker::I32 => Val::Int(i64::from(i32::from_be_bytes(self.be()?))),
            Marker::I64 => Val::Int(i64::from_be_bytes(self.be()?)),
            Marker::F32 => Val::F(f64::from(f32::from_be_bytes(self.be()?))),
            Marker::F64 => Val::F(f64::from_be_bytes(self.be()?)),
            Marker::FixStr(n) => Val::Str(self.take(usize::from(n))?),
            Marker::Str8 => Val::Str({
                let n = self.len8()?;
                self.take(n)?
            }),
            Marker::Str16 => Val::Str({
                let n = self.len16()?;
                self.take(n)?
            }),
            Marker::Str32 => Val::Str({
                let n = self.len32()?;
                self.take(n)?
            }),
            Marker::Bin8 => Val::Bin({
                let n = self.len8()?;
                self.take(n)?
            }),
            Marker::Bin16 => Val::Bin({
                let n = self.len16()?;
                self.take(n)?
            }),
            Marker::Bin32 => Val::Bin({
                let n = self.len32()?;
                self.take(n)?
            }),
            Marker::FixArray(n) => Val::Array(u32::from(n)),
            Marker::Array16 => Val::Array(u32::from(u16::from_be_bytes(self.be()?))),
            Marker::Array32 => Val::Array(u32::from_be_bytes(self.be()?)),
            Marker::FixMap(n) => Val::Map(u32::from(n)),
            Marker::Map16 => Val::Map(u32::from(u16::from_be_bytes(self.be()?))),
            Marker::Map32 => Val::Map(u32::from_be_bytes(self.be()?)),
            Marker::FixExt1 => self.ext(1)?,
            Marker::FixExt2 => self.ext(2)?,
            Marker::FixExt4 => self.ext(4)?,
            Marker::FixExt8 => self.ext(8)?,
            Marker::FixExt16 => self.ext(16)?,
            Marker::Ext8 => {
                let n = self.len8()?;
                self.ext(n)?
            }
            Marker::Ext16 => {
                let n = self.len16()?;
                self.ext(n)?
            }
            Marker::Ext32 => {
                let n = self.len32()?;
                self.ext(n)?
            }
            Marker::Reserved => return Err("reserved msgpack marker 0xc1"),
        })
    }

    fn ext(&mut self, n: usize) -> Res<Val<'a>> {
        self.take(n + 1)?; // type byte + data
        Ok(Val::Ext)
    }

    /// Skips the rest of a value whose head was just read.
    fn skip_rest(&mut self, v: Val<'a>) -> Res<()> {
        self.skip_rest_at(v, 0)
    }

    fn skip_rest_at(&mut self, v: Val<'a>, depth: u32) -> Res<()> {
        let items = match v {
            Val::Array(n) => u64::from(n),
            Val::Map(n) => 2 * u64::from(n),
            _ => return Ok(()),
        };
        if depth >= MAX_DEPTH {
            return Err("nested too deeply");
        }
        for _ in 0..items {
            let h = self.head()?;
            self.skip_rest_at(h, depth + 1)?;
        }
        Ok(())
    }

    /// Skips one whole value.
    fn skip(&mut self) -> Res<()> {
        let v = self.head()?;
        self.skip_rest(v)
    }

    /// `Some(value)` for a non-negative int or nil (`Some(None)`); `None` for anything else.
    fn uint_or_nil(&mut self) -> Res<Option<Option<u64>>> {
        Ok(match self.head()? {
            Val::Uint(v) => Some(Some(v)),
            Val::Int(v) => u64::try_from(v).ok().map(Some),
            Val::Nil => Some(None),
            v => {
                self.skip_rest(v)?;
                None
            }
        })
    }

    /// The hot loop: `n` token ids. Returns false (after consuming the list) if one is not a
    /// u32; the caller marks the event invalid. The common encodings (fixint, uint8/16/32) are
    /// read inline from a local cursor; anything else takes the general path.
    fn tokens(&mut self, n: u32, out: &mut Vec<u32>) -> Res<bool> {
        // A local vector: pushing through `&mut Vec` made the compiler reload its length from
        // memory after every element.
        let mut v = std::mem::take(out);
        let res = self.tokens_into(n, &mut v);
        *out = v;
        res
    }

    #[inline]
    fn tokens_into(&mut self, n: u32, out: &mut Vec<u32>) -> Res<bool> {
        // Each element takes at least one byte, so this reserve is bounded by the payload.
        out.reserve((n as usize).min(self.b.len() - self.p));
        let b = self.b;
        let mut p = self.p;
        let mut ok = true;
        let mut left = n;
        // Runs of uint16 ids (0xcd hi lo): four per bounds check.
        while left >= 4 {
            let Some(q) = b.get(p..p + 12) else { break };
            if q[0] != 0xcd || q[3] != 0xcd || q[6] != 0xcd || q[9] != 0xcd {
                break;
            }
            out.extend_from_slice(&[
                u32::from(u16::from_be_bytes([q[1], q[2]])),
                u32::from(u16::from_be_bytes([q[4], q[5]])),
                u32::from(u16::from_be_bytes([q[7], q[8]])),
                u32::from(u16::from_be_bytes([q[10], q[11]])),
            ]);
            p += 12;
            left -= 4;
        }
        for _ in 0..left {
            let t = match b.get(p) {
                Some(&v @ 0x00..=0x7f) => {
                    p += 1;
                    u32::from(v)
                }
                Some(0xcd) => match b.get(p + 1..p + 3) {
                    Some(x) => {
                        p += 3;
                        u32::from(u16::from_be_bytes([x[0], x[1]]))
                    }
                    None => return Err("truncated"),
                },
                Some(0xce) => match b.get(p + 1..p + 5) {
                    Some(x) => {
                        p += 5;
                        u32::from_be_bytes([x[0], x[1], x[2], x[3]])
                    }
                    None => return Err("truncated"),
                },
                Some(0xcc) => match b.get(p + 1) {
                    Some(&x) => {
                        p += 2;
                        u32::from(x)
                    }
                    None => return Err("truncated"),
                },
                Some(_) => {
                    self.p = p;
                    let v = self.head()?;
                    p = self.p;
                    match v {
                        Val::Uint(v) if v <= u64::from(u32::MAX) => v as u32,
                        Val::Int(v) if (0..=i64::from(u32::MAX)).contains(&v) => v as u32,
                        v => {
                            self.skip_rest(v)?;
                            p = self.p;
                            ok = false;
                            continue;
                        }
                    }
                }
                None => return Err("truncated"),
            };
            out.push(t);
        }
        self.p = p;
        Ok(ok)
    }

    /// One `extra_keys` entry: nil, or a tuple hashed over its raw msgpack bytes (msgspec
    /// encodes deterministically; ints use their shortest form).
    fn tuple_hash(&mut self) -> Res<Option<TupleHash>> {
        let start = self.p;
        let v = self.head()?;
        match v {
            Val::Nil => Ok(None),
            Val::Array(n) => {
                let body = self.p;
                let mut first_str = None;
                let mut rest_start = self.p;
                for i in 0..n {
                    let h = self.head()?;
                    if i == 0 {
                        if let Val::Str(s) = h {
                            first_str = Some(xxh3_64(s));
                        }
                    }
                    self.skip_rest_at(h, 1)?;
                    if i == 0 {
                        rest_start = self.p;
                    }
                }
                let end = self.p;
                Ok(Some(TupleHash {
                    full: xxh3_64(&self.b[body..end]) ^ u64::from(n),
                    rest: (n > 1).then(|| xxh3_64(&self.b[rest_start..end]) ^ u64::from(n - 1)),
                    first_str,
                }))
            }
            v => {
                // A bare scalar: lenient, hashed as itself (vLLM sends tuples).
                self.skip_rest(v)?;
                let first_str = match v {
                    Val::Str(s) => Some(xxh3_64(s)),
                    _ => None,
                };
                Ok(Some(TupleHash {
                    full: xxh3_64(&self.b[start..self.p]),
                    rest: None,
                    first_str,
                }))
            }
        }
    }
}
