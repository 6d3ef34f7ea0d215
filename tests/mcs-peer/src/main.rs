//! ironsan-mcs-peer: drives an iSCSI target with a third-party initiator that does several
//! connections per session (MC/S), the crates.io crate `iscsi-client-rs` 0.0.9. One session
//! (one ISID/TSIH) with N TCP connections (CID 0..N-1) writes a known pattern with
//! WRITE(10)/WRITE(16) spread round-robin over the connections, reads it back with
//! READ(10)/READ(16) through a different connection than the one that wrote each range,
//! compares, and logs out (CloseConnection for CIDs > 0, then CloseSession). Prints
//! `MCS-PEER OK` at the end; exits non-zero on any failure or mismatch.
//!
//! Settings via environment variables (all optional):
//!   TARGET=127.0.0.1:3260  TARGET_NAME=iqn.2026-11.org.ironsan:default
//!   INITIATOR=iqn.2025-01.org.example:mcs-peer  NCONN=2  LUN=0
//!   BLOCKS=8 (blocks per command)  NCMDS=8 (commands per pass)  START_LBA=0
//!   DIGEST=None|CRC32C (header and data)  CHAP_USER=.. CHAP_SECRET=..
//!   MRDSL/MAXBURST/FIRSTBURST (the crate refuses a login whose answers differ from these)
//!   IMMEDIATE=Yes|No  INITIAL_R2T=Yes|No  RUST_LOG=info|debug
//!   MAX_INFLIGHT=8 (session-wide cap on outstanding commands: the crate does not follow
//!   MaxCmdSN, so the caller stays inside the target's window)

use std::{collections::HashMap, sync::atomic::Ordering, sync::Arc, time::Duration};

use anyhow::{bail, ensure, Context, Result};
use iscsi_client_rs::{
    cfg::{
        config::{
            AuthConfig, ChapConfig, Config, Extensions, Flow, Identity, Integrity, Limits,
            LoginConfig, Ordering as IscsiOrdering, Recovery, RuntimeConfig, Timers,
            TransportHints, WriteFlow,
        },
        enums::{Digest, SessionType, YesNo},
    },
    client::{client::ClientConnection, pool_sessions::Pool},
    control_block::{
        read::{build_read10, build_read16},
        read_capacity::{build_read_capacity10, parse_read_capacity10_zerocopy},
        write::{build_write10, build_write16},
    },
    models::logout::common::LogoutReason,
    state_machine::{read_states::ReadCtx, write_states::WriteCtx},
    utils::generate_isid,
};

fn env_or(k: &str, d: &str) -> String {
    std::env::var(k).unwrap_or_else(|_| d.to_string())
}
fn env_num<T: std::str::FromStr>(k: &str, d: T) -> T {
    std::env::var(k)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(d)
}
fn yes_no(k: &str, d: bool) -> YesNo {
    match std::env::var(k).as_deref() {
        Ok("Yes") | Ok("yes") | Ok("1") => YesNo::Yes,
        Ok("No") | Ok("no") | Ok("0") => YesNo::No,
        _ => d.into(),
    }
}

fn build_config(nconn: u16) -> Result<Config> {
    let digest = match env_or("DIGEST", "None").as_str() {
        "CRC32C" | "crc32c" => Digest::CRC32C,
        _ => Digest::None,
    };
    let auth = match (std::env::var("CHAP_USER"), std::env::var("CHAP_SECRET")) {
        (Ok(username), Ok(secret)) => AuthConfig::Chap(ChapConfig { username, secret }),
        _ => AuthConfig::None,
    };
    let mut cfg = Config {
        login: LoginConfig {
            identity: Identity {
                session_type: SessionType::Normal,
                initiator_name: env_or("INITIATOR", "iqn.2025-01.org.example:mcs-peer"),
                initiator_alias: String::new(),
                target_name: env_or("TARGET_NAME", "iqn.2026-11.org.ironsan:default"),
                is_x86: YesNo::No,
            },
            auth,
            integrity: Integrity {
                header_digest: digest,
                data_digest: digest,
            },
            // NB: the crate uses these *configured* values for segmentation
            // and refuses the login if the target answers a different value
            // for any key it echoes (see verify_operational_negotiation).
            flow: Flow {
                max_recv_data_segment_length: env_num("MRDSL", 262144),
                max_burst_length: env_num("MAXBURST", 262144),
                first_burst_length: env_num("FIRSTBURST", 65536),
            },
            write_flow: WriteFlow {
                initial_r2t: yes_no("INITIAL_R2T", true),
                immediate_data: yes_no("IMMEDIATE", true),
                max_outstanding_r2t: 1,
            },
            ordering: IscsiOrdering {
                data_pdu_in_order: YesNo::Yes,
                data_sequence_in_order: YesNo::Yes,
            },
            recovery: Recovery {
                error_recovery_level: 0,
            },
            timers: Timers {
                default_time2wait: Duration::from_secs(2),
                default_time2retain: Duration::from_secs(0),
            },
            // Sent as MaxConnections=<nconn> in operational negotiation.
            limits: Limits {
                max_connections: nconn,
            },
            extensions: Extensions {
                task_reporting: None,
                iscsi_protocol_level: None,
                custom: HashMap::new(),
            },
            transport: TransportHints {
                target_address: env_or("TARGET", "127.0.0.1:3260"),
                portal_group_tag: 1,
            },
        },
        runtime: RuntimeConfig {
            max_sessions: 1,
            timeout_connection: Duration::from_secs(10),
        },
    };
    cfg.validate_and_normalize()?;
    Ok(cfg)
}

/// Byte pattern that depends on the absolute LBA and byte offset in the block.
fn pattern(lba: u64, blk: usize, nblocks: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(blk * nblocks);
    for b in 0..nblocks as u64 {
        let l = lba + b;
        for off in 0..blk as u64 {
            v.push((l.wrapping_mul(131) ^ off.wrapping_mul(7) ^ (off >> 8)) as u8);
        }
    }
    v
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .init();

    let nconn: u16 = env_num("NCONN", 2);
    let lun: u64 = env_num::<u64>("LUN", 0) << 48; // flat LUN n -> 8-byte LUN field
    let nblocks: usize = env_num("BLOCKS", 8);
    let ncmds: usize = env_num("NCMDS", 8);
    let start_lba: u64 = env_num("START_LBA", 0);
    let inflight = Arc::new(tokio::sync::Semaphore::new(env_num("MAX_INFLIGHT", 8)));
    ensure!(nconn >= 1);

    let cfg = build_config(nconn)?;
    let target_name: Arc<str> = Arc::from(cfg.login.identity.target_name.as_str());

    // The Pool owns sessions (TSIH -> Session{isid, CmdSN, ITT gen, conns}).
    let pool = Arc::new(Pool::new(&cfg));
    pool.attach_self(); // enables unsolicited NOP-In auto-replies

    // Leading login: CID 0, TSIH 0 -> target assigns TSIH.
    let (isid, isid_hex) = generate_isid();
    let c0 = ClientConnection::connect(cfg.clone(), pool.cancel_token().child_token()).await?;
    let tsih = pool
        .login_and_insert(target_name.clone(), isid, 0, c0)
        .await
        .context("leading login (CID 0)")?;
    println!("session up: ISID={isid_hex} TSIH={tsih} CID=0");

    // Additional connections: same ISID, TSIH from the leading login, new CID.
    for cid in 1..nconn {
        let c = ClientConnection::connect(cfg.clone(), pool.cancel_token().child_token()).await?;
        pool.add_connection_to_session(tsih, cid, c)
            .await
            .with_context(|| format!("add connection CID {cid} to TSIH {tsih}"))?;
        println!("connection added: TSIH={tsih} CID={cid}");
    }
    {
        let s = pool.sessions.get(&tsih).context("session vanished")?;
        let mut cids: Vec<u16> = s.conns.iter().map(|e| *e.key()).collect();
        cids.sort();
        println!(
            "session TSIH={} ISID={:02x?} has CIDs {:?}",
            s.tsih, s.isid, cids
        );
    }

    // READ CAPACITY(10) on CID 0 to learn the block size. The crate does not
    // handle UNIT ATTENTION itself (a fresh LU reports 29h/00h "power on or
    // reset" on the first command), so retry a few times.
    let mut attempt = 0;
    let rc = loop {
        let r = pool
            .execute_with(tsih, 0, move |c, itt, sn, esn| {
                let mut cdb = [0u8; 16];
                build_read_capacity10(&mut cdb, 0, false, 0);
                ReadCtx::new(c, lun, itt, sn, esn, 8, cdb)
            })
            .await;
        match r {
            Ok(rc) => break rc,
            Err(e) if attempt < 3 => {
                println!("READ CAPACITY(10) attempt {attempt} failed (retrying): {e:#}");
                attempt += 1;
            }
            Err(e) => return Err(e.context("READ CAPACITY(10)")),
        }
    };
    let rc10 = parse_read_capacity10_zerocopy(&rc.data)?;
    let blk = rc10.block_len.get() as usize;
    let max_lba = rc10.max_lba.get() as u64;
    println!("capacity: block_len={blk} max_lba={max_lba}");
    ensure!(
        start_lba + (ncmds * nblocks) as u64 <= max_lba + 1,
        "LUN too small for NCMDS*BLOCKS"
    );

    // ---- concurrent writes, round-robin over CIDs, WRITE(10)/(16) alternating
    let t0 = std::time::Instant::now();
    let mut hs = Vec::new();
    for i in 0..ncmds {
        let pool = pool.clone();
        let cid = (i % nconn as usize) as u16;
        let lba = start_lba + (i * nblocks) as u64;
        let data = pattern(lba, blk, nblocks);
        let use16 = i % 2 == 1;
        let permit = inflight.clone().acquire_owned().await?;
        hs.push(tokio::spawn(async move {
            let _permit = permit;
            pool.execute_with(tsih, cid, move |c, itt, sn, esn| {
                let mut cdb = [0u8; 16];
                if use16 {
                    build_write16(&mut cdb, lba, nblocks as u32, 0, 0);
                } else {
                    build_write10(&mut cdb, lba as u32, nblocks as u16, 0, 0);
                }
                WriteCtx::new(c, lun, itt, sn, esn, cdb, data.clone())
            })
            .await
            .with_context(|| {
                format!(
                    "WRITE{} lba={lba} via CID {cid}",
                    if use16 { 16 } else { 10 }
                )
            })?;
            println!(
                "  wrote lba {lba}+{nblocks} via CID {cid} (WRITE{})",
                if use16 { 16 } else { 10 }
            );
            Ok::<_, anyhow::Error>(())
        }));
    }
    for h in hs {
        h.await??;
    }

    // ---- concurrent reads through a different CID than the write, compare
    let mut hs = Vec::new();
    for i in 0..ncmds {
        let pool = pool.clone();
        let cid = ((i + 1) % nconn as usize) as u16;
        let lba = start_lba + (i * nblocks) as u64;
        let want = pattern(lba, blk, nblocks);
        let use16 = i % 2 == 0;
        let len = (blk * nblocks) as u32;
        let permit = inflight.clone().acquire_owned().await?;
        hs.push(tokio::spawn(async move {
            let _permit = permit;
            let out = pool
                .execute_with(tsih, cid, move |c, itt, sn, esn| {
                    let mut cdb = [0u8; 16];
                    if use16 {
                        build_read16(&mut cdb, lba, nblocks as u32, 0, 0);
                    } else {
                        build_read10(&mut cdb, lba as u32, nblocks as u16, 0, 0);
                    }
                    ReadCtx::new(c, lun, itt, sn, esn, len, cdb)
                })
                .await
                .with_context(|| format!("READ lba={lba} via CID {cid}"))?;
            if out.data != want {
                bail!(
                    "DATA MISMATCH at lba {lba} (read via CID {cid}, got {} bytes)",
                    out.data.len()
                );
            }
            println!(
                "  read+verified lba {lba}+{nblocks} via CID {cid} (READ{})",
                if use16 { 16 } else { 10 }
            );
            Ok(())
        }));
    }
    for h in hs {
        h.await??;
    }
    println!("I/O OK in {:?}", t0.elapsed());

    if let Some(s) = pool.sessions.get(&tsih) {
        for e in s.conns.iter() {
            println!(
                "  CID {} ExpStatSN={}",
                e.key(),
                e.value().exp_stat_sn.load(Ordering::SeqCst)
            );
        }
    }

    // ---- logout: CloseConnection for the extra CIDs, then CloseSession.
    for cid in (1..nconn).rev() {
        pool.logout(tsih, LogoutReason::CloseConnection, Some(cid))
            .await
            .with_context(|| format!("logout CloseConnection CID {cid}"))?;
        println!("logged out CID {cid} (CloseConnection)");
    }
    // NB: in 0.0.9 Pool::shutdown_gracefully() quiesces writes *before* it
    // sends Logout, so its CloseSession always fails ("writes are quiesced").
    // Send CloseSession explicitly first, then let shutdown cancel the I/O.
    pool.logout(tsih, LogoutReason::CloseSession, None)
        .await
        .context("logout CloseSession")?;
    println!("session logged out (CloseSession on lowest CID)");
    pool.shutdown_gracefully(Duration::from_secs(5)).await?;
    println!("MCS-PEER OK conns={nconn} cmds={ncmds}");
    Ok(())
}
