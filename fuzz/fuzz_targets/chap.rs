//! CHAP value decoding and verification: `chap::decode_binary` on arbitrary strings with an
//! arbitrary destination size, and a `ChapServer` taken through challenge and `verify` with
//! arbitrary keys. Invariants: decoding respects the size it is told and round-trips through
//! `encode_hex`; an unknown user, a wrong response or a reflected challenge never verifies.
#![no_main]

use ironsan_proto::chap::{decode_binary, encode_hex, ChapAlgorithm, ChapCredentials, ChapServer};
use ironsan_proto::text;
use libfuzzer_sys::fuzz_target;

const USER: &str = "fuzzuser";
const SECRET: &[u8] = b"initiator-secret";

struct Creds(bool);
impl ChapCredentials for Creds {
    fn initiator_secret(&self, user: &str) -> Option<Vec<u8>> {
        (user == USER).then(|| SECRET.to_vec())
    }
    fn target_credentials(&self) -> Option<(String, Vec<u8>)> {
        self.0.then(|| {
            (
                "iqn.2026-11.org.ironsan:test".into(),
                b"target-secret-12".to_vec(),
            )
        })
    }
}

fuzz_target!(|data: &[u8]| {
    if data.len() < 3 {
        return;
    }
    let max = u16::from_le_bytes([data[0], data[1]]) as usize % 2100;
    let cfg = data[2];
    let rest = &data[3..];
    // 1. The decoder alone.
    if let Ok(s) = std::str::from_utf8(rest) {
        if let Some(v) = decode_binary(s, max) {
            assert!(
                v.len() <= max,
                "decoded {} bytes into a {max}-byte buffer",
                v.len()
            );
            assert!(!v.is_empty());
            assert_eq!(decode_binary(&encode_hex(&v), max).as_deref(), Some(&v[..]));
        }
    }
    // 2. A server exchange: CHAP_A from the first record, the rest as the response keys.
    let Ok(pairs) = text::parse(rest) else {
        return;
    };
    let algs: &[ChapAlgorithm] = if cfg & 1 != 0 {
        &ChapAlgorithm::ALL
    } else {
        &[ChapAlgorithm::ALL[0]]
    };
    let mut server = ChapServer::new(algs);
    let challenge: Vec<u8> = (0..16 + (cfg as usize >> 2))
        .map(|i| i as u8 ^ cfg)
        .collect();
    let chap_a = pairs
        .iter()
        .find(|(k, _)| k == "CHAP_A")
        .map_or("5", |(_, v)| v.as_str());
    let id = cfg.rotate_left(3);
    let Ok(keys) = server.challenge(chap_a, id, &challenge) else {
        assert!(!server.awaiting_response());
        return;
    };
    assert!(server.awaiting_response());
    let alg_code: u64 = keys[0].1.parse().unwrap();
    let alg = ChapAlgorithm::from_code(alg_code).unwrap();
    let creds = Creds(cfg & 2 != 0);
    let user = pairs
        .iter()
        .find(|(k, _)| k == "CHAP_N")
        .map(|(_, v)| v.clone());
    let resp = pairs
        .iter()
        .find(|(k, _)| k == "CHAP_R")
        .map(|(_, v)| v.clone());
    let mutual_c = pairs
        .iter()
        .find(|(k, _)| k == "CHAP_C")
        .map(|(_, v)| v.clone());
    let result = server.verify(&pairs, &creds);
    assert!(!server.awaiting_response());
    if let Ok(ok) = result {
        assert_eq!(ok.user, USER);
        assert_eq!(user.as_deref(), Some(USER));
        let expected = alg.response(id, SECRET, &challenge);
        let got = decode_binary(&resp.unwrap(), 1024).unwrap();
        assert_eq!(got, expected, "accepted a wrong CHAP_R");
        if let Some(c) = mutual_c {
            assert_ne!(
                decode_binary(&c, 1024).unwrap(),
                challenge,
                "reflected challenge"
            );
            assert_eq!(ok.reply.len(), 2);
        }
        assert!(server.is_done());
    }
    // A second verify is out of order.
    assert!(server.verify(&pairs, &creds).is_err());
});
