//! CHAP authentication, target side (RFC 7143 §12.1.3, RFC 1994), as a state machine with no
//! RNG: the caller supplies the identifier and challenge bytes from its CSPRNG.
//!
//! ```text
//!   initiator                         target (ChapServer)
//!   CHAP_A=<A1,A2,...>        ──▶     AwaitAlgorithms ── challenge() ──▶ AwaitResponse
//!                             ◀──     CHAP_A=<A> CHAP_I=<I> CHAP_C=<C>
//!   CHAP_N=<N> CHAP_R=<R>
//!   [CHAP_I=<I'> CHAP_C=<C'>] ──▶     AwaitResponse ── verify() ──▶ Done
//!                             ◀──     [CHAP_N=<target> CHAP_R=<R'>]      (mutual CHAP)
//! ```
//!
//! R = H(I || secret || C) with H the agreed algorithm: MD5 (5, required), SHA-256 (7) or
//! SHA3-256 (8), the PPP CHAP algorithm numbers Linux uses. C and R are large-binary-values
//! (at most 1024 bytes, §12.1.3) in hex (`0x`) or base64 (`0b`); we send hex.
//!
//! Safety rules: the response is compared in constant time; an unknown user costs the same hash
//! as a known one and fails with the same error; the initiator's mutual challenge may not equal
//! ours (reflection); the target secret may not equal the initiator's.

use md5::Digest;

/// Largest binary CHAP_C / CHAP_R (RFC 7143 §12.1.3).
pub const MAX_BINARY_LEN: usize = 1024;
/// Shortest challenge we send or accept (RFC 1994 wants it unpredictable; 16 bytes is MD5's
/// block of output and what Linux sends).
pub const MIN_CHALLENGE_LEN: usize = 16;

/// CHAP digest algorithms (PPP authentication algorithm numbers).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ChapAlgorithm {
    Md5,
    Sha256,
    Sha3_256,
}

impl ChapAlgorithm {
    pub const ALL: [ChapAlgorithm; 3] = [
        ChapAlgorithm::Md5,
        ChapAlgorithm::Sha256,
        ChapAlgorithm::Sha3_256,
    ];

    /// The CHAP_A number.
    pub fn code(self) -> u8 {
        match self {
            ChapAlgorithm::Md5 => 5,
            ChapAlgorithm::Sha256 => 7,
            ChapAlgorithm::Sha3_256 => 8,
        }
    }

    pub fn from_code(code: u64) -> Option<Self> {
        ChapAlgorithm::ALL
            .into_iter()
            .find(|a| u64::from(a.code()) == code)
    }

    /// Digest length in bytes.
    pub fn digest_len(self) -> usize {
        match self {
            ChapAlgorithm::Md5 => 16,
            ChapAlgorithm::Sha256 | ChapAlgorithm::Sha3_256 => 32,
        }
    }

    /// H(id || secret || challenge) (RFC 1994 §4.1).
    pub fn response(self, id: u8, secret: &[u8], challenge: &[u8]) -> Vec<u8> {
        fn h<D: Digest>(id: u8, secret: &[u8], challenge: &[u8]) -> Vec<u8> {
            let mut d = D::new();
            d.update([id]);
            d.update(secret);
            d.update(challenge);
            d.finalize().to_vec()
        }
        match self {
            ChapAlgorithm::Md5 => h::<md5::Md5>(id, secret, challenge),
            ChapAlgorithm::Sha256 => h::<sha2::Sha256>(id, secret, challenge),
            ChapAlgorithm::Sha3_256 => h::<sha3::Sha3_256>(id, secret, challenge),
        }
    }
}

/// Why CHAP failed. Everything but [`ChapError::BadChallengeLength`] (our caller's mistake) is
/// reported to the initiator as 0201 "authentication failure", whatever the detail, so failures
/// do not tell an attacker which part was wrong.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ChapError {
    #[error("no CHAP algorithm in common")]
    NoCommonAlgorithm,
    #[error("CHAP key {0} out of order")]
    OutOfOrder(String),
    #[error("CHAP key {0} missing")]
    Missing(&'static str),
    #[error("CHAP key {0} malformed")]
    Malformed(&'static str),
    #[error("authentication failed")]
    AuthenticationFailed,
    #[error("initiator reflected our challenge")]
    ReflectedChallenge,
    #[error("mutual CHAP requested but the target has no credentials")]
    MutualNotConfigured,
    #[error("caller supplied a challenge of {0} bytes")]
    BadChallengeLength(usize),
}

/// Where secrets come from.
pub trait ChapCredentials {
    /// The secret initiator `user` must prove knowledge of; `None` for an unknown user.
    fn initiator_secret(&self, user: &str) -> Option<Vec<u8>>;
    /// The name and secret the target proves itself with (mutual CHAP), if configured.
    fn target_credentials(&self) -> Option<(String, Vec<u8>)>;
}

/// A successful verification.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChapSuccess {
    /// CHAP_N: the authenticated user name.
    pub user: String,
    /// Keys for our response: CHAP_N and CHAP_R for mutual CHAP, else nothing.
    pub reply: Vec<(String, String)>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum State {
    AwaitAlgorithms,
    AwaitResponse {
        alg: ChapAlgorithm,
        id: u8,
        challenge: Vec<u8>,
    },
    Done,
    Failed,
}

/// The target's half of one CHAP exchange.
#[derive(Clone, Debug)]
pub struct ChapServer {
    algorithms: Vec<ChapAlgorithm>,
    state: State,
}

/// Encode bytes as a hex-constant (`0x...`, RFC 7143 §6.1).
pub fn encode_hex(b: &[u8]) -> String {
    let mut s = String::with_capacity(2 + 2 * b.len());
    s.push_str("0x");
    for x in b {
        s.push_str(&format!("{x:02x}"));
    }
    s
}

fn hex_val(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

fn b64_val(c: u8) -> Option<u8> {
    match c {
        b'A'..=b'Z' => Some(c - b'A'),
        b'a'..=b'z' => Some(c - b'a' + 26),
        b'0'..=b'9' => Some(c - b'0' + 52),
        b'+' => Some(62),
        b'/' => Some(63),
        _ => None,
    }
}

/// Decode a binary-value given as a hex-constant (`0x`) or base64-constant (`0b`) into at most
/// `max` bytes (RFC 7143 §6.1). Empty values, odd hex digit counts, bad characters or padding,
/// and anything decoding to more than `max` bytes are refused before allocating.
pub fn decode_binary(v: &str, max: usize) -> Option<Vec<u8>> {
    let b = v.as_bytes();
    if b.len() < 3 || b[0] != b'0' {
        return None;
    }
    let body = &b[2..];
    match b[1] {
        b'x' | b'X' => {
            if !body.len().is_multiple_of(2) || body.len() / 2 > max {
                return None;
            }
            body.chunks(2)
                .map(|p| Some(hex_val(p[0])? << 4 | hex_val(p[1])?))
                .collect()
        }
        b'b' | b'B' => {
            if !body.len().is_multiple_of(4) {
                return None;
            }
            let pad = body.iter().rev().take_while(|&&c| c == b'=').count();
            if pad > 2 || body.len() / 4 * 3 - pad > max {
                return None;
            }
            let data = &body[..body.len() - pad];
            let mut out = Vec::with_capacity(body.len() / 4 * 3);
            let (mut acc, mut bits) = (0u32, 0u32);
            for &c in data {
                acc = acc << 6 | u32::from(b64_val(c)?);
                bits += 6;
                if bits >= 8 {
                    bits -= 8;
                    out.push((acc >> bits) as u8);
                    acc &= (1 << bits) - 1;
                }
            }
            // Leftover bits must be zero (canonical encoding).
            (acc == 0).then_some(out)
        }
        _ => None,
    }
}

/// Equality that takes the same time wherever the first difference is.
fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn value<'a>(pairs: &'a [(String, String)], key: &str) -> Option<&'a str> {
    pairs
        .iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.as_str())
}

impl ChapServer {
    /// `algorithms`: the ones we accept (the initiator's order decides among them).
    pub fn new(algorithms: &[ChapAlgorithm]) -> Self {
        ChapServer {
            algorithms: algorithms.to_vec(),
            state: State::AwaitAlgorithms,
        }
    }

    /// True once the initiator proved itself (and, for mutual CHAP, we answered).
    pub fn is_done(&self) -> bool {
        self.state == State::Done
    }

    /// True between our challenge and the initiator's response.
    pub fn awaiting_response(&self) -> bool {
        matches!(self.state, State::AwaitResponse { .. })
    }

    /// Answer the initiator's CHAP_A list with CHAP_A, CHAP_I and CHAP_C. `id` and `challenge`
    /// come from the caller's CSPRNG (challenge: 16..=1024 bytes, fresh for every login).
    pub fn challenge(
        &mut self,
        chap_a: &str,
        id: u8,
        challenge: &[u8],
    ) -> Result<Vec<(String, String)>, ChapError> {
        let r = self.challenge_inner(chap_a, id, challenge);
        if r.is_err() {
            self.state = State::Failed;
        }
        r
    }

    fn challenge_inner(
        &mut self,
        chap_a: &str,
        id: u8,
        challenge: &[u8],
    ) -> Result<Vec<(String, String)>, ChapError> {
        if self.state != State::AwaitAlgorithms {
            return Err(ChapError::OutOfOrder("CHAP_A".into()));
        }
        if !(MIN_CHALLENGE_LEN..=MAX_BINARY_LEN).contains(&challenge.len()) {
            return Err(ChapError::BadChallengeLength(challenge.len()));
        }
        let alg = chap_a
            .split(',')
            .filter_map(|a| crate::negotiate::parse_number(a).and_then(ChapAlgorithm::from_code))
            .find(|a| self.algorithms.contains(a))
            .ok_or(ChapError::NoCommonAlgorithm)?;
        self.state = State::AwaitResponse {
            alg,
            id,
            challenge: challenge.to_vec(),
        };
        Ok(vec![
            ("CHAP_A".to_owned(), alg.code().to_string()),
            ("CHAP_I".to_owned(), id.to_string()),
            ("CHAP_C".to_owned(), encode_hex(challenge)),
        ])
    }

    /// Check the initiator's CHAP_N / CHAP_R (and answer its CHAP_I / CHAP_C for mutual CHAP).
    pub fn verify(
        &mut self,
        pairs: &[(String, String)],
        creds: &dyn ChapCredentials,
    ) -> Result<ChapSuccess, ChapError> {
        let r = self.verify_inner(pairs, creds);
        self.state = if r.is_ok() {
            State::Done
        } else {
            State::Failed
        };
        r
    }

    fn verify_inner(
        &mut self,
        pairs: &[(String, String)],
        creds: &dyn ChapCredentials,
    ) -> Result<ChapSuccess, ChapError> {
        let State::AwaitResponse { alg, id, challenge } = &self.state else {
            return Err(ChapError::OutOfOrder("CHAP_R".into()));
        };
        if let Some((k, _)) = pairs.iter().find(|(k, _)| k == "CHAP_A") {
            return Err(ChapError::OutOfOrder(k.clone()));
        }
        let user = value(pairs, "CHAP_N").ok_or(ChapError::Missing("CHAP_N"))?;
        let response = value(pairs, "CHAP_R").ok_or(ChapError::Missing("CHAP_R"))?;
        let response =
            decode_binary(response, MAX_BINARY_LEN).ok_or(ChapError::Malformed("CHAP_R"))?;
        // Unknown users cost a hash too, and fail the same way as a wrong secret.
        let known = creds.initiator_secret(user);
        let secret = known.clone().unwrap_or_else(|| vec![0u8; 16]);
        let expected = alg.response(*id, &secret, challenge);
        if !(ct_eq(&expected, &response) && known.is_some()) {
            return Err(ChapError::AuthenticationFailed);
        }

        let mutual_i = value(pairs, "CHAP_I");
        let mutual_c = value(pairs, "CHAP_C");
        let reply = match (mutual_i, mutual_c) {
            (None, None) => Vec::new(),
            (Some(i), Some(c)) => {
                let i = crate::negotiate::parse_number(i)
                    .filter(|&i| i <= 255)
                    .ok_or(ChapError::Malformed("CHAP_I"))? as u8;
                let c = decode_binary(c, MAX_BINARY_LEN)
                    .filter(|c| !c.is_empty())
                    .ok_or(ChapError::Malformed("CHAP_C"))?;
                if ct_eq(&c, challenge) {
                    return Err(ChapError::ReflectedChallenge);
                }
                let (name, target_secret) = creds
                    .target_credentials()
                    .ok_or(ChapError::MutualNotConfigured)?;
                if ct_eq(&target_secret, &secret) {
                    return Err(ChapError::MutualNotConfigured);
                }
                vec![
                    ("CHAP_N".to_owned(), name),
                    (
                        "CHAP_R".to_owned(),
                        encode_hex(&alg.response(i, &target_secret, &c)),
                    ),
                ]
            }
            (None, Some(_)) => return Err(ChapError::Missing("CHAP_I")),
            (Some(_), None) => return Err(ChapError::Missing("CHAP_C")),
        };
        Ok(ChapSuccess {
            user: user.to_owned(),
            reply,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: &[u8] = b"secretsecret1234";
    const TARGET_SECRET: &[u8] = b"targetsecret5678";

    struct Creds {
        mutual: bool,
    }
    impl ChapCredentials for Creds {
        fn initiator_secret(&self, user: &str) -> Option<Vec<u8>> {
            (user == "alice").then(|| SECRET.to_vec())
        }
        fn target_credentials(&self) -> Option<(String, Vec<u8>)> {
            self.mutual.then(|| {
                (
                    "iqn.2024-01.com.example:disk".into(),
                    TARGET_SECRET.to_vec(),
                )
            })
        }
    }

    fn p(v: &[(&str, &str)]) -> Vec<(String, String)> {
        v.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn challenge_bytes() -> Vec<u8> {
        (0u8..16).collect()
    }

    fn started(alg: &str) -> ChapServer {
        let mut s = ChapServer::new(&ChapAlgorithm::ALL);
        s.challenge(alg, 0x2a, &challenge_bytes()).unwrap();
        s
    }

    // Vectors computed independently with Python's hashlib: H(0x2a || SECRET || 00..0f).
    const MD5_R: &str = "0xa384beacb762b68badaf6f7ffc818bb4";
    const SHA256_R: &str = "0x172dd61e091999e46cfecf02168a8c4521f57d816b023125b5825b7c06448e00";
    const SHA3_R: &str = "0x8fd011ad0e800f7374c799c2c9d7b847c52dd994dc01106c9c7665a6d4b27993";

    #[test]
    fn challenge_picks_the_first_offered_algorithm_we_support() {
        let mut s = ChapServer::new(&[ChapAlgorithm::Md5, ChapAlgorithm::Sha256]);
        let out = s.challenge("8,7,5", 0x2a, &challenge_bytes()).unwrap();
        assert_eq!(
            out,
            p(&[
                ("CHAP_A", "7"),
                ("CHAP_I", "42"),
                ("CHAP_C", "0x000102030405060708090a0b0c0d0e0f")
            ])
        );
        assert!(s.awaiting_response());
    }

    #[test]
    fn challenge_without_a_common_algorithm_fails() {
        let mut s = ChapServer::new(&[ChapAlgorithm::Md5]);
        assert_eq!(
            s.challenge("6,129", 1, &challenge_bytes()),
            Err(ChapError::NoCommonAlgorithm)
        );
        assert_eq!(
            ChapServer::new(&[ChapAlgorithm::Md5]).challenge("x", 1, &challenge_bytes()),
            Err(ChapError::NoCommonAlgorithm)
        );
    }

    #[test]
    fn challenge_refuses_short_caller_entropy() {
        let mut s = ChapServer::new(&ChapAlgorithm::ALL);
        assert_eq!(
            s.challenge("5", 1, &[0u8; 8]),
            Err(ChapError::BadChallengeLength(8))
        );
    }

    #[test]
    fn verifies_md5_sha256_and_sha3_responses() {
        for (alg, r) in [("5", MD5_R), ("7", SHA256_R), ("8", SHA3_R)] {
            let mut s = started(alg);
            let ok = s
                .verify(
                    &p(&[("CHAP_N", "alice"), ("CHAP_R", r)]),
                    &Creds { mutual: false },
                )
                .unwrap();
            assert_eq!(ok.user, "alice");
            assert!(ok.reply.is_empty());
            assert!(s.is_done());
        }
    }

    #[test]
    fn accepts_base64_and_uppercase_hex_responses() {
        let bin = decode_binary(MD5_R, 1024).unwrap();
        let b64 = {
            // Base64 built by hand for the test (standard alphabet, padded).
            const A: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
            let mut s = String::from("0b");
            for ch in bin.chunks(3) {
                let n = ch.iter().fold(0u32, |a, &b| a << 8 | u32::from(b)) << (8 * (3 - ch.len()));
                for i in 0..=ch.len() {
                    s.push(A[(n >> (18 - 6 * i) & 63) as usize] as char);
                }
                for _ in ch.len()..3 {
                    s.push('=');
                }
            }
            s
        };
        for r in [b64, MD5_R.to_uppercase().replacen("0X", "0x", 1)] {
            let mut s = started("5");
            assert!(s
                .verify(
                    &p(&[("CHAP_N", "alice"), ("CHAP_R", &r)]),
                    &Creds { mutual: false }
                )
                .is_ok());
        }
    }

    #[test]
    fn wrong_secret_and_unknown_user_fail_the_same_way() {
        let mut s = started("5");
        let wrong = "0x00000000000000000000000000000000";
        assert_eq!(
            s.verify(
                &p(&[("CHAP_N", "alice"), ("CHAP_R", wrong)]),
                &Creds { mutual: false }
            ),
            Err(ChapError::AuthenticationFailed)
        );
        let mut s = started("5");
        assert_eq!(
            s.verify(
                &p(&[("CHAP_N", "mallory"), ("CHAP_R", MD5_R)]),
                &Creds { mutual: false }
            ),
            Err(ChapError::AuthenticationFailed)
        );
    }

    #[test]
    fn wrong_length_response_fails() {
        let mut s = started("5");
        assert_eq!(
            s.verify(
                &p(&[("CHAP_N", "alice"), ("CHAP_R", "0x00")]),
                &Creds { mutual: false }
            ),
            Err(ChapError::AuthenticationFailed)
        );
    }

    #[test]
    fn keys_out_of_order_fail() {
        let mut s = ChapServer::new(&ChapAlgorithm::ALL);
        assert!(matches!(
            s.verify(
                &p(&[("CHAP_N", "alice"), ("CHAP_R", MD5_R)]),
                &Creds { mutual: false }
            ),
            Err(ChapError::OutOfOrder(_))
        ));
        let mut s = started("5");
        assert!(matches!(
            s.challenge("5", 1, &challenge_bytes()),
            Err(ChapError::OutOfOrder(_))
        ));
        // After a failure nothing succeeds any more.
        assert!(s
            .verify(
                &p(&[("CHAP_N", "alice"), ("CHAP_R", MD5_R)]),
                &Creds { mutual: false }
            )
            .is_err());
        let mut s = started("5");
        assert!(matches!(
            s.verify(
                &p(&[("CHAP_A", "5"), ("CHAP_N", "alice"), ("CHAP_R", MD5_R)]),
                &Creds { mutual: false }
            ),
            Err(ChapError::OutOfOrder(_))
        ));
    }

    #[test]
    fn missing_keys_fail() {
        let mut s = started("5");
        assert_eq!(
            s.verify(&p(&[("CHAP_R", MD5_R)]), &Creds { mutual: false }),
            Err(ChapError::Missing("CHAP_N"))
        );
        let mut s = started("5");
        assert_eq!(
            s.verify(&p(&[("CHAP_N", "alice")]), &Creds { mutual: false }),
            Err(ChapError::Missing("CHAP_R"))
        );
    }

    #[test]
    fn mutual_chap_answers_the_initiator_challenge() {
        let mut s = started("5");
        let c: Vec<u8> = (100u8..132).collect();
        let ok = s
            .verify(
                &p(&[
                    ("CHAP_N", "alice"),
                    ("CHAP_R", MD5_R),
                    ("CHAP_I", "7"),
                    ("CHAP_C", &encode_hex(&c)),
                ]),
                &Creds { mutual: true },
            )
            .unwrap();
        assert_eq!(
            ok.reply,
            p(&[
                ("CHAP_N", "iqn.2024-01.com.example:disk"),
                ("CHAP_R", "0x1e6748bb748768679933f6e035bd20bf"),
            ])
        );
    }

    #[test]
    fn mutual_chap_refuses_a_reflected_challenge() {
        let mut s = started("5");
        assert_eq!(
            s.verify(
                &p(&[
                    ("CHAP_N", "alice"),
                    ("CHAP_R", MD5_R),
                    ("CHAP_I", "42"),
                    ("CHAP_C", &encode_hex(&challenge_bytes())),
                ]),
                &Creds { mutual: true },
            ),
            Err(ChapError::ReflectedChallenge)
        );
    }

    #[test]
    fn mutual_chap_without_target_credentials_or_with_bad_keys_fails() {
        let base = [("CHAP_N", "alice"), ("CHAP_R", MD5_R)];
        for (extra, creds, err) in [
            (
                vec![("CHAP_I", "7"), ("CHAP_C", "0x0102")],
                false,
                ChapError::MutualNotConfigured,
            ),
            (
                vec![("CHAP_I", "256"), ("CHAP_C", "0x0102")],
                true,
                ChapError::Malformed("CHAP_I"),
            ),
            (
                vec![("CHAP_I", "7"), ("CHAP_C", "0x012")],
                true,
                ChapError::Malformed("CHAP_C"),
            ),
            (
                vec![("CHAP_C", "0x0102")],
                true,
                ChapError::Missing("CHAP_I"),
            ),
            (vec![("CHAP_I", "7")], true, ChapError::Missing("CHAP_C")),
        ] {
            let mut s = started("5");
            let mut pairs = base.to_vec();
            pairs.extend(extra);
            assert_eq!(s.verify(&p(&pairs), &Creds { mutual: creds }), Err(err));
        }
    }

    #[test]
    fn binary_decoder_refuses_hostile_encodings() {
        assert_eq!(decode_binary("0x0aFF", 16), Some(vec![0x0a, 0xff]));
        assert_eq!(decode_binary("0bYWI=", 16), Some(b"ab".to_vec()));
        assert_eq!(
            decode_binary("0bAAECAwQFBgcICQoLDA0ODw==", 16),
            Some((0u8..16).collect())
        );
        for bad in [
            "", "0x", "0b", "0x1", "0x0g", "1x00", "0z00", "0bYWI", "0bY===", "0bYW=I", "0bYWJ=",
            "0b!!!!",
        ] {
            assert_eq!(decode_binary(bad, 16), None, "{bad:?}");
        }
        // Size bounds are checked against the destination.
        assert_eq!(decode_binary(&encode_hex(&[0u8; 17]), 16), None);
        assert!(decode_binary(&encode_hex(&[0u8; 16]), 16).is_some());
        assert_eq!(decode_binary("0bAAAAAAAAAAAAAAAAAAAAAAAA", 16), None);
    }
}
