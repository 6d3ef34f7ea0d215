//! The login state machine driven by an arbitrary sequence of PDUs, exactly as the server's
//! login phase drives it (`crates/server/src/iscsi/conn.rs` `login_phase`): PDUs read from a byte
//! stream with the 8192-byte login limit, C-bit text joined by `text::Assembler`, parsed by
//! `text::parse` (failures answered with `Login::fail`), then `Login::step` under a policy
//! chosen by the first byte (authentication required or not, mutual CHAP, CSPRNG bytes given
//! or not). Invariants: no panic; every response answers the request's ISID/ITT and fits one
//! 8192-byte login PDU as parseable text; the login never reaches full-feature phase without
//! CHAP when authentication is required; nothing after a failure.
#![no_main]

use ironsan_fuzz::{next_pdu, Wire};
use ironsan_proto::chap::{ChapAlgorithm, ChapCredentials};
use ironsan_proto::login::{
    Login, LoginPolicy, LoginStatus, LoginStep, TargetLookup, CHAP_RANDOM_LEN,
    LOGIN_MAX_DATA_SEGMENT_LENGTH,
};
use ironsan_proto::negotiate::TargetDefaults;
use ironsan_proto::pdu::{Header, LoginResponse, TargetSn, Tsih};
use ironsan_proto::text;
use ironsan_proto::CmdSn;
use libfuzzer_sys::fuzz_target;

pub const TARGET: &str = "iqn.2026-11.org.ironsan:test";
pub const USER: &str = "fuzzuser";
pub const SECRET: &[u8] = b"initiator-secret";
pub const TARGET_SECRET: &[u8] = b"target-secret-12";

struct Policy {
    auth: bool,
    mutual: bool,
}

impl ChapCredentials for Policy {
    fn initiator_secret(&self, user: &str) -> Option<Vec<u8>> {
        (user == USER).then(|| SECRET.to_vec())
    }
    fn target_credentials(&self) -> Option<(String, Vec<u8>)> {
        self.mutual
            .then(|| (TARGET.to_owned(), TARGET_SECRET.to_vec()))
    }
}

impl LoginPolicy for Policy {
    fn lookup_target(&self, target: &str, _initiator: &str) -> TargetLookup {
        match target {
            TARGET => TargetLookup::Allowed {
                tpgt: 1,
                alias: Some("fuzz".into()),
                max_connections: None,
                error_recovery_level: None,
            },
            "iqn.2026-11.org.ironsan:denied" => TargetLookup::Denied,
            "iqn.2026-11.org.ironsan:moved" => TargetLookup::Moved {
                address: "127.0.0.1:3261,1".into(),
                permanent: true,
            },
            _ => TargetLookup::NotFound,
        }
    }
    fn discovery_allowed(&self, initiator: &str) -> bool {
        !initiator.ends_with(":nodisc")
    }
    fn auth_required(&self, _target: Option<&str>, _initiator: &str) -> bool {
        self.auth
    }
    fn chap_credentials(&self, _target: Option<&str>) -> Option<&dyn ChapCredentials> {
        Some(self)
    }
}

/// The fixed "CSPRNG" bytes: CHAP_I = 7, CHAP_C = 32 bytes 0x10..0x30. Seeds carry the right
/// MD5 response for them so the fuzzer starts past authentication.
pub fn random() -> [u8; CHAP_RANDOM_LEN] {
    let mut r = [0u8; CHAP_RANDOM_LEN];
    r[0] = 7;
    for (i, b) in r[1..].iter_mut().enumerate() {
        *b = 0x10 + i as u8;
    }
    r
}

fn check_response(rsp: &LoginResponse, data: &bytes::Bytes, req_isid: [u8; 6], req_itt: u32) {
    assert!(
        data.len() <= LOGIN_MAX_DATA_SEGMENT_LENGTH as usize,
        "login response of {} bytes exceeds one login PDU",
        data.len()
    );
    text::parse(data).unwrap_or_else(|e| panic!("our login text is malformed: {e}"));
    assert_eq!(rsp.isid.0, req_isid);
    assert_eq!(rsp.itt.0, req_itt);
    assert!(rsp.csg.0 <= 3 && rsp.nsg.0 <= 3);
}

fuzz_target!(|data: &[u8]| {
    let Some((&cfg, mut input)) = data.split_first() else {
        return;
    };
    let policy = Policy {
        auth: cfg & 1 != 0,
        mutual: cfg & 2 != 0,
    };
    let mut login = Login::new(TargetDefaults::default());
    if cfg & 4 == 0 {
        login.set_random(random());
    }
    let mut asm = text::Assembler::default();
    let mut ended = false;
    loop {
        let (_bhs, pdu) = match next_pdu(&mut input, LOGIN_MAX_DATA_SEGMENT_LENGTH) {
            Wire::Pdu(b, p) => (b, p),
            Wire::TooLong | Wire::Short => return,
        };
        let Header::LoginRequest(req) = pdu.header else {
            // The server closes the connection on any other PDU during login.
            return;
        };
        if ended {
            // The server has closed by now; the machine must refuse to resume anyway.
            assert!(matches!(
                login.step(&req, Vec::new(), &policy),
                LoginStep::Fail(..)
            ));
            return;
        }
        let parsed = match asm.push(&pdu.data, req.cont) {
            Ok(Some(t)) => text::parse(&t).map_err(|e| LoginStatus::from(&e)),
            Ok(None) => Ok(Vec::new()),
            Err(e) => Err(LoginStatus::from(&e)),
        };
        let pairs = match parsed {
            Ok(p) => p,
            Err(status) => {
                let (rsp, d) = login.fail(&req, status);
                check_response(&rsp, &d, req.isid.0, req.itt.0);
                assert_eq!(rsp.status_class, 2);
                return;
            }
        };
        match login.step(&req, pairs, &policy) {
            LoginStep::Respond(rsp, d) => {
                check_response(&rsp, &d, req.isid.0, req.itt.0);
                assert_eq!((rsp.status_class, rsp.status_detail), (0, 0));
                // We never agree to full-feature phase without ReadyToComplete.
                assert!(!(rsp.transit && rsp.nsg.0 == 3));
            }
            LoginStep::Fail(rsp, d) => {
                check_response(&rsp, &d, req.isid.0, req.itt.0);
                assert!(rsp.status_class != 0);
                assert!(!rsp.transit);
                ended = true;
                // A real server closes here; feed one more request to check the machine
                // refuses it instead of resuming.
            }
            LoginStep::ReadyToComplete(ready) => {
                if policy.auth {
                    assert!(
                        ready.auth_user.as_deref() == Some(USER),
                        "full-feature phase reached without authentication: {ready:?}"
                    );
                }
                assert!(ironsan_proto::negotiate::valid_iscsi_name(
                    &ready.initiator_name
                ));
                if cfg & 8 != 0 {
                    let (rsp, d) = login.reject(LoginStatus::TOO_MANY_CONNECTIONS);
                    check_response(&rsp, &d, req.isid.0, req.itt.0);
                } else {
                    let tsih = if ready.tsih.0 == 0 {
                        Tsih(1)
                    } else {
                        ready.tsih
                    };
                    let sn = TargetSn {
                        stat_sn: ready.stat_sn,
                        exp_cmd_sn: ready.cmd_sn,
                        max_cmd_sn: CmdSn(ready.cmd_sn.0.wrapping_add(127)),
                    };
                    let (rsp, d, s, c) = login.complete(tsih, sn);
                    check_response(&rsp, &d, req.isid.0, req.itt.0);
                    assert!(rsp.transit && rsp.nsg.0 == 3 && rsp.status_class == 0);
                    assert!(s.first_burst_length <= s.max_burst_length);
                    assert!(c.max_recv_data_segment_length >= 512);
                    assert!(c.max_xmit_data_segment_length >= 512);
                    let _ = ChapAlgorithm::ALL;
                }
                return;
            }
        }
    }
});
