//! Text key=value data segments (RFC 7143 §6.1), their assembly across C-bit continuation PDUs
//! and their segmentation into outgoing PDUs (§6.2, §11.10.2, §11.11.2).
//!
//! ```text
//! data segment := record*           record := key "=" value NUL
//! key          := 1..=63 bytes of [A-Za-z0-9.+@_-]   ("X#" also allowed as a prefix, RFC 4850)
//! value        := UTF-8 without control characters, ≤ 255 bytes (≤ 8192 for large-binary keys)
//! ```
//!
//! Everything here is bounded before it allocates: the number of pairs, each key and value, and
//! the total bytes an [`Assembler`] will hold.

use bytes::{Bytes, BytesMut};

/// Longest key name (RFC 7143 §6.1: "key-name ... MUST NOT exceed 63 bytes").
pub const MAX_KEY_LEN: usize = 63;
/// Longest value unless the key allows more (RFC 7143 §6.1: a simple-value is at most 255 bytes).
pub const MAX_VALUE_LEN: usize = 255;
/// Longest encoded value of a large-binary-value key. CHAP_C and CHAP_R are at most 1024 binary
/// bytes (RFC 7143 §12.1.3), i.e. 2050 characters in hex; 8192 leaves room for any encoding while
/// still bounding a single value. The CHAP decoder enforces the binary limit itself.
pub const MAX_LARGE_VALUE_LEN: usize = 8192;
/// Default bound on pairs in one text exchange.
pub const MAX_PAIRS: usize = 256;
/// Default bound on a text exchange assembled from C-bit continuation PDUs.
pub const MAX_ASSEMBLED_LEN: usize = 64 * 1024;
/// Default bound on the number of PDUs in one continued exchange (so empty C=1 PDUs cannot
/// continue forever).
pub const MAX_ASSEMBLED_PDUS: usize = 256;

/// Keys whose values are large-binary-values (RFC 7143 §12.1.3).
const LARGE_VALUE_KEYS: &[&str] = &["CHAP_C", "CHAP_R"];

/// The longest value `key` may carry.
pub fn max_value_len(key: &str) -> usize {
    if LARGE_VALUE_KEYS.contains(&key) {
        MAX_LARGE_VALUE_LEN
    } else {
        MAX_VALUE_LEN
    }
}

/// Why a text data segment was refused. Every variant is the peer's fault; during login the
/// caller answers with status 0200 "initiator error" (RFC 7143 §11.13.5), in full-feature phase
/// with a Reject PDU (protocol error, §11.17.1).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TextError {
    #[error("the last key=value record is not NUL-terminated")]
    MissingTerminator,
    #[error("record {index} has no '='")]
    MissingEquals { index: usize },
    #[error("record {index} has an empty key")]
    EmptyKey { index: usize },
    #[error("key of {len} bytes exceeds {MAX_KEY_LEN}")]
    KeyTooLong { len: usize },
    #[error("key contains a byte outside the RFC 7143 key character set")]
    BadKeyChar,
    #[error("value of {key} is {len} bytes, over the limit of {max}")]
    ValueTooLong { key: String, len: usize, max: usize },
    #[error("value of {key} contains a control character")]
    ControlChar { key: String },
    #[error("text is not valid UTF-8")]
    InvalidUtf8,
    #[error("key {0} appears twice")]
    DuplicateKey(String),
    #[error("more than {max} key=value pairs")]
    TooManyPairs { max: usize },
    #[error("continued text exceeds {max} bytes")]
    TooLarge { max: usize },
    #[error("continued text spans more than {max} PDUs")]
    TooManyPdus { max: usize },
}

/// Parsing limits. [`Limits::default`] is what a target applies to initiator text.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub max_pairs: usize,
    /// Keys that may repeat. Empty for negotiation (RFC 7143 §6.2: a key negotiated twice is an
    /// error); an initiator parsing a SendTargets response passes `&["TargetName",
    /// "TargetAddress"]` (§13.3).
    pub repeatable: &'static [&'static str],
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_pairs: MAX_PAIRS,
            repeatable: &[],
        }
    }
}

/// Keys a SendTargets response repeats (RFC 7143 §13.3, Appendix C).
pub const SEND_TARGETS_REPEATABLE: &[&str] = &["TargetName", "TargetAddress"];

/// Parse a complete text data segment with the default [`Limits`].
pub fn parse(data: &[u8]) -> Result<Vec<(String, String)>, TextError> {
    parse_with(data, &Limits::default())
}

fn valid_key_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'+' | b'@' | b'_')
}

fn check_key(key: &[u8], index: usize) -> Result<(), TextError> {
    if key.is_empty() {
        return Err(TextError::EmptyKey { index });
    }
    if key.len() > MAX_KEY_LEN {
        return Err(TextError::KeyTooLong { len: key.len() });
    }
    // Public extension keys are spelled "X#name" (RFC 4850, kept by RFC 7143), the one place
    // a '#' appears.
    let body = key.strip_prefix(b"X#").unwrap_or(key);
    if body.iter().all(|&b| valid_key_byte(b)) {
        Ok(())
    } else {
        Err(TextError::BadKeyChar)
    }
}

/// Parse a complete text data segment. Trailing NUL bytes after the last record are tolerated
/// (some initiators pad the segment with zeros); anything else must be well formed.
pub fn parse_with(data: &[u8], limits: &Limits) -> Result<Vec<(String, String)>, TextError> {
    // Strip zero padding; a record still needs its own terminator, so keep one NUL.
    let end = data.iter().rposition(|&b| b != 0).map_or(0, |p| p + 1);
    if end == 0 {
        return Ok(Vec::new());
    }
    if end == data.len() {
        return Err(TextError::MissingTerminator);
    }
    let body = &data[..end];
    let mut pairs: Vec<(String, String)> = Vec::new();
    for (index, record) in body.split(|&b| b == 0).enumerate() {
        if pairs.len() == limits.max_pairs {
            return Err(TextError::TooManyPairs {
                max: limits.max_pairs,
            });
        }
        let eq = record
            .iter()
            .position(|&b| b == b'=')
            .ok_or(TextError::MissingEquals { index })?;
        let (key, value) = (&record[..eq], &record[eq + 1..]);
        check_key(key, index)?;
        // The key is ASCII by now.
        let key = String::from_utf8(key.to_vec()).map_err(|_| TextError::InvalidUtf8)?;
        let max = max_value_len(&key);
        if value.len() > max {
            return Err(TextError::ValueTooLong {
                key,
                len: value.len(),
                max,
            });
        }
        let value = std::str::from_utf8(value).map_err(|_| TextError::InvalidUtf8)?;
        if value.chars().any(char::is_control) {
            return Err(TextError::ControlChar { key });
        }
        if !limits.repeatable.contains(&key.as_str()) && pairs.iter().any(|(k, _)| *k == key) {
            return Err(TextError::DuplicateKey(key));
        }
        pairs.push((key, value.to_owned()));
    }
    Ok(pairs)
}

/// Encode pairs as `key=value\0` records.
pub fn encode<K: AsRef<str>, V: AsRef<str>>(pairs: &[(K, V)]) -> Bytes {
    let len = pairs
        .iter()
        .map(|(k, v)| k.as_ref().len() + v.as_ref().len() + 2)
        .sum();
    let mut out = BytesMut::with_capacity(len);
    for (k, v) in pairs {
        out.extend_from_slice(k.as_ref().as_bytes());
        out.extend_from_slice(b"=");
        out.extend_from_slice(v.as_ref().as_bytes());
        out.extend_from_slice(b"\0");
    }
    out.freeze()
}

/// Collects a text exchange that the peer split over several PDUs with the C (continue) bit
/// (RFC 7143 §11.10.2, §11.12.2): a key=value pair may straddle PDUs, so the bytes are joined
/// before parsing. Bounded in bytes and in PDUs.
#[derive(Debug)]
pub struct Assembler {
    buf: BytesMut,
    pdus: usize,
    max_len: usize,
    max_pdus: usize,
}

impl Default for Assembler {
    fn default() -> Self {
        Assembler::new(MAX_ASSEMBLED_LEN, MAX_ASSEMBLED_PDUS)
    }
}

impl Assembler {
    pub fn new(max_len: usize, max_pdus: usize) -> Self {
        Assembler {
            buf: BytesMut::new(),
            pdus: 0,
            max_len,
            max_pdus,
        }
    }

    /// Add one PDU's data segment. Returns the whole text once a PDU arrives with C=0, and resets
    /// for the next exchange. After an error the caller drops the exchange (or the connection);
    /// the assembler is reset either way.
    pub fn push(&mut self, data: &[u8], cont: bool) -> Result<Option<Bytes>, TextError> {
        self.pdus += 1;
        if self.pdus > self.max_pdus {
            self.reset();
            return Err(TextError::TooManyPdus { max: self.max_pdus });
        }
        if self.buf.len() + data.len() > self.max_len {
            self.reset();
            return Err(TextError::TooLarge { max: self.max_len });
        }
        self.buf.extend_from_slice(data);
        if cont {
            return Ok(None);
        }
        self.pdus = 0;
        Ok(Some(std::mem::take(&mut self.buf).freeze()))
    }

    /// True while a continued exchange is incomplete.
    pub fn in_progress(&self) -> bool {
        self.pdus > 0
    }

    pub fn reset(&mut self) {
        self.buf = BytesMut::new();
        self.pdus = 0;
    }
}

/// One outgoing chunk of a text exchange: send it with the C bit set to `cont`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Segment {
    pub data: Bytes,
    pub cont: bool,
}

/// Splits an outgoing text exchange into data segments no larger than the peer's
/// MaxRecvDataSegmentLength (RFC 7143 §6.2, §11.11.2): every chunk but the last goes out with
/// C=1 (and, for a Text Response, F=0 and a Target Transfer Tag the initiator echoes in an empty
/// Text Request to fetch the next one). An empty text yields one empty final segment.
#[derive(Debug)]
pub struct Segmenter {
    data: Bytes,
    max: usize,
    done: bool,
}

impl Segmenter {
    /// `max_segment` is clamped to at least 1 byte.
    pub fn new(data: Bytes, max_segment: u32) -> Self {
        Segmenter {
            data,
            max: (max_segment as usize).max(1),
            done: false,
        }
    }

    /// Bytes not yet handed out.
    pub fn remaining(&self) -> usize {
        self.data.len()
    }
}

impl Iterator for Segmenter {
    type Item = Segment;

    fn next(&mut self) -> Option<Segment> {
        if self.done {
            return None;
        }
        let n = self.data.len().min(self.max);
        let data = self.data.split_to(n);
        let cont = !self.data.is_empty();
        self.done = !cont;
        Some(Segment { data, cont })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn pairs(v: &[(&str, &str)]) -> Vec<(String, String)> {
        v.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn parses_nul_terminated_records() {
        let got =
            parse(b"InitiatorName=iqn.2024-01.x:y\0SessionType=Normal\0HeaderDigest=\0").unwrap();
        assert_eq!(
            got,
            pairs(&[
                ("InitiatorName", "iqn.2024-01.x:y"),
                ("SessionType", "Normal"),
                ("HeaderDigest", ""),
            ])
        );
        assert_eq!(parse(b"").unwrap(), vec![]);
    }

    #[test]
    fn value_keeps_everything_after_the_first_equals() {
        assert_eq!(parse(b"X-a=b=c\0").unwrap(), pairs(&[("X-a", "b=c")]));
    }

    #[test]
    fn tolerates_trailing_zero_padding() {
        assert_eq!(parse(b"A=1\0\0\0\0").unwrap(), pairs(&[("A", "1")]));
        assert_eq!(parse(b"\0\0").unwrap(), vec![]);
    }

    #[test]
    fn rejects_record_without_nul_terminator() {
        assert_eq!(parse(b"A=1\0B=2"), Err(TextError::MissingTerminator));
    }

    #[test]
    fn rejects_record_without_equals() {
        assert_eq!(
            parse(b"A=1\0Bogus\0"),
            Err(TextError::MissingEquals { index: 1 })
        );
        // An empty record in the middle has no '=' either.
        assert_eq!(
            parse(b"A=1\0\0B=2\0"),
            Err(TextError::MissingEquals { index: 1 })
        );
    }

    #[test]
    fn rejects_empty_key() {
        assert_eq!(parse(b"=x\0"), Err(TextError::EmptyKey { index: 0 }));
    }

    #[test]
    fn rejects_key_over_63_bytes() {
        let ok = format!("{}=1\0", "K".repeat(63));
        assert!(parse(ok.as_bytes()).is_ok());
        let long = format!("{}=1\0", "K".repeat(64));
        assert_eq!(
            parse(long.as_bytes()),
            Err(TextError::KeyTooLong { len: 64 })
        );
    }

    #[test]
    fn rejects_key_characters_outside_the_rfc_set() {
        assert_eq!(parse(b"Bad Key=1\0"), Err(TextError::BadKeyChar));
        assert_eq!(parse(b"A#B=1\0"), Err(TextError::BadKeyChar));
        assert_eq!(parse("Ké=1\0".as_bytes()), Err(TextError::BadKeyChar));
        assert!(parse(b"X#NodeArchitecture=Linux\0").is_ok());
        assert!(parse(b"X-com.example.a+b@c_d=1\0").is_ok());
    }

    #[test]
    fn rejects_value_over_255_bytes_except_for_large_binary_keys() {
        let ok = format!("TargetAlias={}\0", "a".repeat(255));
        assert!(parse(ok.as_bytes()).is_ok());
        let long = format!("TargetAlias={}\0", "a".repeat(256));
        assert_eq!(
            parse(long.as_bytes()),
            Err(TextError::ValueTooLong {
                key: "TargetAlias".into(),
                len: 256,
                max: 255
            })
        );
        let chap = format!("CHAP_C=0x{}\0", "ab".repeat(1024));
        assert!(parse(chap.as_bytes()).is_ok());
        let huge = format!("CHAP_C={}\0", "a".repeat(8193));
        assert!(matches!(
            parse(huge.as_bytes()),
            Err(TextError::ValueTooLong { max: 8192, .. })
        ));
    }

    #[test]
    fn rejects_duplicate_keys_unless_repeatable() {
        assert_eq!(
            parse(b"MaxBurstLength=1\0MaxBurstLength=2\0"),
            Err(TextError::DuplicateKey("MaxBurstLength".into()))
        );
        let limits = Limits {
            repeatable: SEND_TARGETS_REPEATABLE,
            ..Limits::default()
        };
        let st = b"TargetName=iqn.a\0TargetAddress=1.2.3.4\0TargetName=iqn.b\0";
        assert_eq!(parse_with(st, &limits).unwrap().len(), 3);
    }

    #[test]
    fn rejects_more_than_the_pair_limit() {
        let mut s = String::new();
        for i in 0..=MAX_PAIRS {
            s.push_str(&format!("X-k{i}=v\0"));
        }
        assert_eq!(
            parse(s.as_bytes()),
            Err(TextError::TooManyPairs { max: MAX_PAIRS })
        );
        let small = Limits {
            max_pairs: 2,
            ..Limits::default()
        };
        assert!(parse_with(b"A=1\0B=2\0", &small).is_ok());
        assert!(parse_with(b"A=1\0B=2\0C=3\0", &small).is_err());
    }

    #[test]
    fn rejects_control_characters_and_invalid_utf8_in_values() {
        assert_eq!(
            parse(b"InitiatorAlias=a\x01b\0"),
            Err(TextError::ControlChar {
                key: "InitiatorAlias".into()
            })
        );
        assert_eq!(
            parse(b"InitiatorAlias=a\nb\0"),
            Err(TextError::ControlChar {
                key: "InitiatorAlias".into()
            })
        );
        assert_eq!(
            parse(b"InitiatorAlias=\x7f\0"),
            Err(TextError::ControlChar {
                key: "InitiatorAlias".into()
            })
        );
        assert_eq!(
            parse(b"InitiatorAlias=\xff\xfe\0"),
            Err(TextError::InvalidUtf8)
        );
        // UTF-8 aliases are legal (iSCSI-local-name-value).
        assert!(parse("InitiatorAlias=Grüße\0".as_bytes()).is_ok());
    }

    #[test]
    fn encode_round_trips_through_parse() {
        let p = pairs(&[
            ("HeaderDigest", "CRC32C,None"),
            ("MaxBurstLength", "262144"),
        ]);
        let wire = encode(&p);
        assert_eq!(
            &wire[..],
            b"HeaderDigest=CRC32C,None\0MaxBurstLength=262144\0"
        );
        assert_eq!(parse(&wire).unwrap(), p);
        assert!(encode::<&str, &str>(&[]).is_empty());
    }

    #[test]
    fn assembler_joins_pairs_split_across_continuation_pdus() {
        let mut a = Assembler::default();
        assert_eq!(a.push(b"InitiatorNa", true), Ok(None));
        assert!(a.in_progress());
        assert_eq!(a.push(b"me=iqn.x\0Sess", true), Ok(None));
        let whole = a.push(b"ionType=Normal\0", false).unwrap().unwrap();
        assert!(!a.in_progress());
        assert_eq!(
            parse(&whole).unwrap(),
            pairs(&[("InitiatorName", "iqn.x"), ("SessionType", "Normal")])
        );
        // Reusable for the next exchange.
        assert_eq!(&a.push(b"A=1\0", false).unwrap().unwrap()[..], b"A=1\0");
    }

    #[test]
    fn assembler_refuses_more_than_its_byte_bound() {
        let mut a = Assembler::new(16, 100);
        assert_eq!(a.push(&[b'a'; 10], true), Ok(None));
        assert_eq!(
            a.push(&[b'a'; 7], true),
            Err(TextError::TooLarge { max: 16 })
        );
        assert!(!a.in_progress());
        // Exactly at the bound is fine.
        assert!(a.push(&[b'a'; 16], false).unwrap().is_some());
    }

    #[test]
    fn assembler_refuses_endless_empty_continuation() {
        let mut a = Assembler::new(1 << 16, 4);
        for _ in 0..4 {
            assert_eq!(a.push(b"", true), Ok(None));
        }
        assert_eq!(a.push(b"", true), Err(TextError::TooManyPdus { max: 4 }));
    }

    #[test]
    fn segmenter_splits_at_the_peer_limit_with_continue_bits() {
        let data = Bytes::from(vec![7u8; 20]);
        let segs: Vec<Segment> = Segmenter::new(data.clone(), 8).collect();
        assert_eq!(segs.len(), 3);
        assert_eq!(
            segs.iter()
                .map(|s| (s.data.len(), s.cont))
                .collect::<Vec<_>>(),
            vec![(8, true), (8, true), (4, false)]
        );
        let joined: Vec<u8> = segs.iter().flat_map(|s| s.data.iter().copied()).collect();
        assert_eq!(joined, data.to_vec());
        // Exact multiple: no empty trailing segment.
        let segs: Vec<Segment> = Segmenter::new(Bytes::from(vec![0u8; 16]), 8).collect();
        assert_eq!(segs.len(), 2);
        assert!(!segs[1].cont);
    }

    #[test]
    fn segmenter_emits_one_empty_final_segment_for_empty_text() {
        let segs: Vec<Segment> = Segmenter::new(Bytes::new(), 8192).collect();
        assert_eq!(
            segs,
            vec![Segment {
                data: Bytes::new(),
                cont: false
            }]
        );
    }

    proptest! {
        #[test]
        fn segmenter_and_assembler_round_trip(len in 0usize..5000, max in 1u32..3000) {
            let data: Bytes = (0..len).map(|i| i as u8).collect::<Vec<u8>>().into();
            let mut a = Assembler::new(1 << 16, 10_000);
            let mut out = None;
            for seg in Segmenter::new(data.clone(), max) {
                prop_assert!(seg.data.len() <= max as usize);
                out = a.push(&seg.data, seg.cont).unwrap();
            }
            prop_assert_eq!(out.unwrap(), data);
        }

        #[test]
        fn parse_never_panics(data in proptest::collection::vec(any::<u8>(), 0..600)) {
            let _ = parse(&data);
        }
    }
}
