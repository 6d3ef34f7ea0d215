//! CDB parsing and command execution: a sequence of commands with arbitrary CDBs and Data-Out
//! against a target of two RAM LUs (512- and 4096-byte blocks, so EXTENDED COPY has a
//! partner) from two nexuses, with `data_out_len` asked first as the server does.
//! Invariants: no panic; CHECK CONDITION iff fixed-format sense data of at least 18 bytes;
//! Data-In bounded by the transfer limit; what a WRITE(10/16) reported GOOD reads back.
#![no_main]

use bytes::Bytes;
use ironsan_backend::RamBackend;
use ironsan_fuzz::block_on;
use ironsan_scsi::{Command, LogicalUnit, LuConfig, Nexus, Status, Target, MAX_TRANSFER_BYTES};
use libfuzzer_sys::fuzz_target;
use std::sync::Arc;

/// One command of the input. Format (so captured SCSI Command PDUs make seeds directly):
/// `sel` (bits 0-1 LUN choice, bit 2 nexus, bits 3-7 repeat count), `cdb_len` u8, CDB,
/// `data_len` u16 LE, Data-Out, `expected_in_len` u32 LE.
struct Cmd<'a> {
    lun: u8,
    nexus: bool,
    cdb: &'a [u8],
    data: &'a [u8],
    /// Repeat the data to reach a block multiple (WRITE SAME, COMPARE AND WRITE...).
    repeat: u8,
    expected_in_len: u32,
}

fn take<'a>(b: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
    if b.len() < n {
        return None;
    }
    let (h, t) = b.split_at(n);
    *b = t;
    Some(h)
}

fn parse(mut b: &[u8]) -> (u8, Vec<Cmd<'_>>) {
    let mut cmds = Vec::new();
    let Some(cfg) = take(&mut b, 1) else {
        return (0, cmds);
    };
    while cmds.len() < 16 {
        let Some(sel) = take(&mut b, 1) else { break };
        let Some(n) = take(&mut b, 1) else { break };
        let Some(cdb) = take(&mut b, n[0] as usize) else {
            break;
        };
        let Some(dl) = take(&mut b, 2) else { break };
        let dl = u16::from_le_bytes([dl[0], dl[1]]) as usize;
        let avail = b.len();
        let data = take(&mut b, dl.min(avail)).unwrap_or(&[]);
        let e = take(&mut b, 4).unwrap_or(&[0, 0, 0, 0]);
        cmds.push(Cmd {
            lun: sel[0] & 3,
            nexus: sel[0] & 4 != 0,
            cdb,
            data,
            repeat: sel[0] >> 3,
            expected_in_len: u32::from_le_bytes([e[0], e[1], e[2], e[3]]),
        });
    }
    (cfg[0], cmds)
}

fn nexus(id: u64) -> Nexus {
    Nexus {
        id,
        initiator_port: format!("iqn.2026-11.org.ironsan:i{id},i,0x80000000000{id}").into(),
        target_port: "iqn.2026-11.org.ironsan:test,t,0x0001".into(),
        relative_port: 1,
    }
}

fn target(wce: bool, read_only: bool) -> Target {
    let mut t = Target::new();
    for (lun, bs, size, naa) in [
        (0u64, 512u32, 1u64 << 20, 0x3000_0000_0000_0001u64),
        (1, 4096, 2 << 20, 0x3000_0000_0000_0002),
    ] {
        let lu = LogicalUnit::new(
            Arc::new(RamBackend::new(size)),
            LuConfig {
                block_size: bs,
                write_cache: wce,
                read_only: read_only && lun == 1,
                naa,
                ..Default::default()
            },
        );
        t.add_lun(lun, Arc::new(lu));
    }
    t
}

fuzz_target!(|input: &[u8]| {
    let (cfg, cmds) = parse(input);
    let t = target(cfg & 1 != 0, cfg & 2 != 0);
    let nexuses = [nexus(1), nexus(2)];
    for c in &cmds {
        let lun = match c.lun {
            0 | 3 => 0,
            1 => 1,
            _ => 7, // no LU there
        };
        let bs = t.lun(lun).map_or(512, |l| l.block_size());
        let mut data = c.data.to_vec();
        if c.repeat > 0 && !data.is_empty() {
            let want = (c.repeat as usize * 512).min(16 * 1024);
            while data.len() < want {
                data.extend_from_within(..data.len().min(want - data.len()));
            }
        }
        // The transport asks how much Data-Out the CDB wants before soliciting it.
        let _ = ironsan_scsi::data_out_len(c.cdb, bs);
        let cmd = Command {
            cdb: Bytes::copy_from_slice(c.cdb),
            data_out: Bytes::from(data.clone()),
            expected_in_len: c.expected_in_len,
            // RAM and null LUNs here: holes and null reads may answer from the zero file.
            in_place: Some(ironsan_backend::InPlaceRead {
                min: 0,
                from: ironsan_backend::SendFrom::Mapping,
                zero_page: true,
            }),
        };
        let n = &nexuses[c.nexus as usize];
        let r = block_on(t.execute(lun, n, cmd));
        assert_eq!(r.status == Status::CHECK_CONDITION, r.sense.is_some());
        if let Some(s) = &r.sense {
            assert!(s.len() >= 18);
            assert_eq!(s[0] & 0x7f, 0x70, "sense is not fixed format");
            assert!(r.data_in.is_empty());
        }
        assert!(r.data_in.len() <= MAX_TRANSFER_BYTES as usize + 4096);
        // A WRITE(10)/WRITE(16) that succeeded must read back what was sent.
        if r.status == Status::GOOD
            && lun != 7
            && (c.cdb.first() == Some(&0x2a) || c.cdb.first() == Some(&0x8a))
        {
            let (lba, blocks) = if c.cdb[0] == 0x2a {
                (
                    u32::from_be_bytes([c.cdb[2], c.cdb[3], c.cdb[4], c.cdb[5]]) as u64,
                    u16::from_be_bytes([c.cdb[7], c.cdb[8]]) as u64,
                )
            } else {
                (
                    u64::from_be_bytes(c.cdb[2..10].try_into().unwrap()),
                    u32::from_be_bytes(c.cdb[10..14].try_into().unwrap()) as u64,
                )
            };
            let sent_blocks = (data.len() as u64 / bs as u64).min(blocks);
            if sent_blocks > 0 {
                let mut rd = [0u8; 16];
                rd[0] = 0x88;
                rd[2..10].copy_from_slice(&lba.to_be_bytes());
                rd[10..14].copy_from_slice(&(sent_blocks as u32).to_be_bytes());
                let back = block_on(t.execute(
                    lun,
                    n,
                    Command {
                        cdb: Bytes::copy_from_slice(&rd),
                        data_out: Bytes::new(),
                        expected_in_len: (sent_blocks * bs as u64) as u32,
                        in_place: None,
                    },
                ));
                // A unit attention or reservation may stand in the way; data must match
                // whenever it is returned.
                if back.status == Status::GOOD {
                    let len = (sent_blocks * bs as u64) as usize;
                    let ironsan_scsi::DataIn::Memory(got) = &back.data_in else {
                        panic!("a RAM LUN answered with a file range");
                    };
                    assert_eq!(&got[..], &data[..len], "write did not read back");
                }
            }
        }
    }
});
