//! Text key parsing and negotiation: `text::parse` (and the C-bit `Assembler`) on arbitrary
//! bytes, then `Negotiator::respond` over two rounds in a chosen stage, `finish`, and a
//! full-feature `respond_full_feature`. Invariants: our answers are themselves well-formed
//! text, fit a login PDU when the request did, and the outcome stays in RFC 7143 ranges.
#![no_main]

use ironsan_proto::negotiate::{Negotiator, TargetDefaults};
use ironsan_proto::pdu::Stage;
use ironsan_proto::text::{self, Assembler, Limits, SEND_TARGETS_REPEATABLE};
use libfuzzer_sys::fuzz_target;

fn check_answers(answers: &[(String, String)]) {
    let enc = text::encode(answers);
    // Everything we send must parse with the same rules we apply to the initiator (except
    // that a value we echo could be one the initiator sent: bounded by what parse allowed).
    text::parse_with(
        &enc,
        &Limits {
            max_pairs: usize::MAX,
            repeatable: &[],
        },
    )
    .unwrap_or_else(|e| panic!("our answer is malformed text ({e}): {answers:?}"));
}

fuzz_target!(|data: &[u8]| {
    let Some((&cfg, body)) = data.split_first() else {
        return;
    };
    let _ = text::parse_with(
        body,
        &Limits {
            max_pairs: 16,
            repeatable: SEND_TARGETS_REPEATABLE,
        },
    );
    // Split into continuation PDUs at a fuzzer-chosen stride.
    let stride = (cfg as usize >> 4) * 61 + 1;
    let mut asm = Assembler::new(4096, 8);
    let chunks: Vec<&[u8]> = body.chunks(stride).collect();
    for (i, c) in chunks.iter().enumerate() {
        match asm.push(c, i + 1 < chunks.len()) {
            Ok(Some(t)) => assert_eq!(&t[..], body),
            Ok(None) => {}
            Err(_) => break,
        }
    }
    // Two negotiation rounds: the body split at a NUL near the middle.
    let mid = body
        .iter()
        .skip(body.len() / 2)
        .position(|&b| b == 0)
        .map_or(body.len(), |p| body.len() / 2 + p + 1);
    let (a, b) = body.split_at(mid);
    let defaults = TargetDefaults {
        max_recv_data_segment_length: if cfg & 8 != 0 { 4096 } else { 262_144 },
        max_burst_length: if cfg & 8 != 0 { 1024 } else { 1 << 20 },
        initial_r2t: cfg & 4 != 0,
        ..TargetDefaults::default()
    };
    let mut n = Negotiator::new(&defaults);
    n.set_leading(cfg & 1 == 0);
    if cfg & 2 != 0 {
        n.set_auth_methods(&["CHAP"]);
    }
    let stage = if cfg & 0x10 != 0 {
        Stage::SECURITY_NEGOTIATION
    } else {
        Stage::LOGIN_OPERATIONAL_NEGOTIATION
    };
    for part in [a, b] {
        let Ok(pairs) = text::parse(part) else {
            continue;
        };
        match n.respond(stage, &pairs) {
            Ok(answers) => {
                check_answers(&answers);
                assert!(answers.len() <= pairs.len() + 1);
            }
            Err(_) => return,
        }
    }
    let _ = n.unsent_declarations();
    if let Ok((s, c)) = n.finish() {
        assert!(s.first_burst_length <= s.max_burst_length);
        assert!((512..=(1 << 24) - 1).contains(&s.max_burst_length));
        assert!((512..=(1 << 24) - 1).contains(&c.max_xmit_data_segment_length));
        assert!((512..=(1 << 24) - 1).contains(&c.max_recv_data_segment_length));
        assert!(s.max_outstanding_r2t >= 1 && s.max_outstanding_r2t <= 65535);
        assert!(s.max_connections >= 1);
        assert!(s.error_recovery_level <= defaults.error_recovery_level);
        assert!(!s.initiator_name.is_empty());
        let _ = ironsan_proto::negotiate::describe(&s, &c);
    }
    if let Ok(pairs) = text::parse(body) {
        let ff = n.respond_full_feature(&pairs);
        check_answers(&ff.pairs);
        if let Some(m) = ff.max_xmit_data_segment_length {
            assert!((512..=(1 << 24) - 1).contains(&m));
        }
    }
});
