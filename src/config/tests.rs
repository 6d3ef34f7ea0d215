use super::*;
use ironsan_server::limits::parse_duration;

#[test]
fn parses_every_lun_spec_form() {
    let d = Path::new("/data");
    assert_eq!(
        parse_lun_spec("null:16T", d),
        Ok(Backing::Null { size: 16 << 40 })
    );
    assert_eq!(
        parse_lun_spec("ram:1G", d),
        Ok(Backing::Ram { size: 1 << 30 })
    );
    assert_eq!(
        parse_lun_spec("file:/dev/sdb", d),
        Ok(Backing::File {
            path: "/dev/sdb".into(),
            size: None
        })
    );
    assert_eq!(
        parse_lun_spec("file:x.img:2G", d),
        Ok(Backing::File {
            path: "/data/x.img".into(),
            size: Some(2 << 30)
        })
    );
    assert!(parse_lun_spec("ram:lots", d)
        .unwrap_err()
        .contains("not a size"));
    assert!(parse_lun_spec("tape:1G", d)
        .unwrap_err()
        .contains("unknown backend 'tape'"));
    assert!(parse_lun_spec("ram", d).is_err());
    assert!(parse_lun_spec("ram:0", d).is_err());
}

#[test]
fn lun_options_follow_the_spec() {
    let d = Path::new("/data");
    let p = parse_lun("ram:1G,ro,wce,bs=4096,pbs=8192,serial=AB12", d).unwrap();
    assert!(p.read_only && p.write_cache && !p.direct);
    assert_eq!((p.block_size, p.physical_block_size), (4096, 8192));
    assert_eq!(p.serial.as_deref(), Some("AB12"));
    assert!(parse_lun("file:x.img:1G,direct", d).unwrap().direct);
    assert!(parse_lun("ram:1G,fast", d)
        .unwrap_err()
        .contains("unknown LUN option 'fast'"));
    assert!(parse_lun("ram:1G,bs=1000", d)
        .unwrap_err()
        .contains("power of two"));
    assert!(parse_lun("ram:1G,bs=4096,pbs=512", d)
        .unwrap_err()
        .contains("pbs"));
}

#[test]
fn lun_identity_naa_and_serial() {
    let d = Path::new("/data");
    let p = parse_lun("ram:1G,serial=DISK-01,naa=0x3000c0ffee000001", d).unwrap();
    assert_eq!(p.serial.as_deref(), Some("DISK-01"));
    assert_eq!(p.naa, Some(0x3000_c0ff_ee00_0001));
    assert_eq!(parse_naa("5000C0FFEE000001"), Ok(0x5000_c0ff_ee00_0001));
    assert_eq!(parse_naa("0x2000000000000001"), Ok(0x2000_0000_0000_0001));
    for (v, what) in [
        ("0x3000c0ffee0001", "16 hex digits"),
        ("0x3000c0ffee00000g", "16 hex digits"),
        ("0x6000c0ffee000001", "not an 8-byte format"),
        ("0x1000c0ffee000001", "not an 8-byte format"),
        ("", "16 hex digits"),
    ] {
        let e = parse_naa(v).unwrap_err();
        assert!(e.contains(what), "{v}: {e}");
    }
    for bad in ["", "a b", "a,b", &"x".repeat(65)] {
        assert!(check_serial(bad).is_err(), "{bad:?}");
    }
    assert!(parse_lun("ram:1G,serial=", d).is_err());
    let text = r#"
[[target]]
name = "iqn.2026-11.org.x:a"
[[target.lun]]
spec = "ram:1M"
serial = "S1"
naa = "0x3000000000000001"
[[target.lun]]
spec = "ram:1M,naa=0x5000000000000002"
[[target]]
name = "iqn.2026-11.org.x:b"
[[target.lun]]
spec = "ram:1M"
"#;
    let plan = parse_file(text, Path::new("t.toml")).unwrap();
    let l = &plan.targets[0].luns;
    assert_eq!(
        (l[0].serial.as_deref(), l[0].naa),
        (Some("S1"), Some(0x3000_0000_0000_0001))
    );
    assert_eq!(
        (l[1].serial.as_deref(), l[1].naa),
        (None, Some(0x5000_0000_0000_0002))
    );
    assert_eq!(plan.targets[1].luns[0].naa, None);
    let base = "[[target]]\nname = \"iqn.2026-11.org.x:a\"\n[[target.lun]]\nspec = \"ram:1M\"\n";
    for (text, want) in [
        (format!("{base}naa = \"0x6000000000000001\"\n"), "t.toml:5: "),
        (format!("{base}naa = \"0x30\"\n"), "t.toml:5: "),
        (format!("{base}serial = \"a b\"\n"), "t.toml:5: "),
        (
            format!("{base}naa = \"0x3000000000000001\"\n[[target.lun]]\nspec = \"ram:1M\"\nnaa = \"3000000000000001\"\n"),
            "same naa",
        ),
    ] {
        let e = parse_file(&text, Path::new("t.toml")).unwrap_err().to_string();
        assert!(e.contains(want), "{e}\n{text}");
    }
}

#[test]
fn alua_groups_from_the_file_and_what_is_wrong_with_them() {
    let head = r#"
[[portal_group]]
tag = 1
listen = ["127.0.0.1:3260"]
[[portal_group]]
tag = 2
listen = ["127.0.0.1:3261"]
[[portal_group]]
tag = 3
listen = ["127.0.0.1:3262"]
[[target]]
name = "iqn.2026-11.org.x:a"
portal_groups = [1, 2]
[[target.lun]]
spec = "ram:1M"
"#;
    let ok = format!(
        "{head}[[target.alua_group]]\nid = 10\nportal_groups = [1]\npreferred = true\n\
         [[target.alua_group]]\nid = 20\nportal_groups = [2]\nstate = \"standby\"\n"
    );
    let plan = parse_file(&ok, Path::new("t.toml")).unwrap();
    let g = plan.targets[0].alua.as_ref().unwrap();
    assert_eq!(
        (g[0].id, g[0].ports.clone(), g[0].preferred),
        (10, vec![1], true)
    );
    assert_eq!(
        (g[1].id, g[1].state),
        (20, ironsan_scsi::AccessState::Standby)
    );
    let bad = |extra: &str| {
        parse_file(&format!("{head}{extra}"), Path::new("t.toml"))
            .unwrap_err()
            .to_string()
    };
    let two = "[[target.alua_group]]\nid = 1\nportal_groups = [1, 2]\n\
               [[target.alua_group]]\nid = 2\nportal_groups = [2]\n";
    let e = bad(two);
    assert!(
        e.starts_with("t.toml:21:") && e.contains("portal group 2 is already in alua_group 1"),
        "{e}"
    );
    let e = bad("[[target.alua_group]]\nid = 1\nportal_groups = [3]\n");
    assert!(e.contains("portal group 3 does not serve target"), "{e}");
    let e = bad("[[target.alua_group]]\nid = 1\nportal_groups = [1]\n");
    assert!(
        e.contains("portal group 2 serves target iqn.2026-11.org.x:a but is in no"),
        "{e}"
    );
    let e =
        bad("[[target.alua_group]]\nid = 1\nportal_groups = [1, 2]\nstate = \"transitioning\"\n");
    assert!(
        e.starts_with("t.toml:19:") && e.contains("is not a state"),
        "{e}"
    );
    let e = bad("[[target.alua_group]]\nid = 0\nportal_groups = [1, 2]\n");
    assert!(e.contains("between 1 and 65535"), "{e}");
    let e = bad("[[target.alua_group]]\nid = 1\nportal_groups = [1]\n[[target.alua_group]]\nid = 1\nportal_groups = [2]\n");
    assert!(e.contains("alua_group 1 is defined twice"), "{e}");
}

#[test]
fn portal_groups_and_target_membership() {
    let text = r#"
[[portal_group]]
tag = 1
listen = ["127.0.0.1:3260", "[::1]:3260"]
[[portal_group]]
tag = 7
listen = ["127.0.0.1:3261"]
[[target]]
name = "iqn.2026-11.org.x:a"
portal_groups = [7]
[[target.lun]]
spec = "ram:1M"
[[target]]
name = "iqn.2026-11.org.x:b"
[[target.lun]]
spec = "ram:1M"
"#;
    let plan = parse_file(text, Path::new("t.toml")).unwrap();
    assert_eq!(
        plan.portal_groups,
        vec![
            PortalGroup {
                tag: 1,
                listen: vec![
                    "127.0.0.1:3260".parse().unwrap(),
                    "[::1]:3260".parse().unwrap()
                ]
            },
            PortalGroup {
                tag: 7,
                listen: vec!["127.0.0.1:3261".parse().unwrap()]
            },
        ]
    );
    assert_eq!(plan.targets[0].portal_groups, Some(vec![7]));
    assert_eq!(plan.targets[1].portal_groups, None);
    // listen = [...] alone is group 1; with [[portal_group]]s it is group 1 beside them.
    let lun = "[[target]]\nname = \"iqn.2026-11.org.x:a\"\n[[target.lun]]\nspec = \"ram:1M\"\n";
    let plan = parse_file(
        &format!("listen = [\"127.0.0.1:3260\"]\n{lun}"),
        Path::new("t.toml"),
    )
    .unwrap();
    assert_eq!(plan.portal_groups.len(), 1);
    assert_eq!(plan.portal_groups[0].tag, 1);
    let plan = parse_file(
        &format!("listen = [\"127.0.0.1:3260\"]\n[[portal_group]]\ntag = 2\nlisten = [\"127.0.0.1:3261\"]\n{lun}"),
        Path::new("t.toml"),
    )
    .unwrap();
    assert_eq!(
        plan.portal_groups.iter().map(|g| g.tag).collect::<Vec<_>>(),
        vec![1, 2]
    );
    let g =
        |tag: &str, listen: &str| format!("[[portal_group]]\ntag = {tag}\nlisten = [{listen}]\n");
    for (text, line, what) in [
        (g("0", "\"127.0.0.1:1\""), 2, "1 to 65535"),
        (g("65536", "\"127.0.0.1:1\""), 2, "1 to 65535"),
        (g("2", ""), 3, "no listen address"),
        (g("2", "\"nowhere\""), 3, "not ADDR:PORT"),
        (
            format!("{}{}", g("2", "\"127.0.0.1:1\""), g("2", "\"127.0.0.1:2\"")),
            5,
            "defined twice",
        ),
        (
            format!("listen = [\"127.0.0.1:1\"]\n{}", g("1", "\"127.0.0.1:2\"")),
            3,
            "listen = [...] is portal group 1",
        ),
        (
            format!("{}{}", g("2", "\"127.0.0.1:1\""), g("3", "\"127.0.0.1:1\"")),
            6,
            "two portal groups",
        ),
    ] {
        let text = format!("{text}{lun}");
        let e = parse_file(&text, Path::new("t.toml"))
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with(&format!("t.toml:{line}: ")) && e.contains(what),
            "{e}\n{text}"
        );
    }
    let t = |groups: &str| {
        format!("{}[[target]]\nname = \"iqn.2026-11.org.x:a\"\nportal_groups = {groups}\n[[target.lun]]\nspec = \"ram:1M\"\n", g("2", "\"127.0.0.1:1\""))
    };
    let e = parse_file(&t("[3]"), Path::new("t.toml"))
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("t.toml:6: ") && e.contains("no [[portal_group]] with tag 3"),
        "{e}"
    );
    let e = parse_file(&t("[]"), Path::new("t.toml"))
        .unwrap_err()
        .to_string();
    assert!(e.starts_with("t.toml:6: ") && e.contains("empty"), "{e}");
    assert_eq!(
        parse_file(&t("[2, 2]"), Path::new("t.toml"))
            .unwrap()
            .targets[0]
            .portal_groups,
        Some(vec![2])
    );
}

#[test]
fn fault_options_are_validated_and_kept() {
    let d = Path::new("/data");
    let p = parse_lun(
        "ram:64M,fault=read@1000-1010:eio,fault=write@rate=0.01,fault=any@rate=0.1:delay=50ms,fault-seed=7",
        d,
    )
    .unwrap();
    assert_eq!(p.faults.len(), 3);
    assert_eq!(p.fault_seed, 7);
    assert!(parse_lun("ram:64M", d).unwrap().faults.is_empty());
    assert!(parse_lun("ram:64M,fault=read@9-1", d)
        .unwrap_err()
        .contains("fault rule"));
}

#[test]
fn config_source_prefers_flag_then_env_then_flags_then_default_file() {
    let dir = tempfile::tempdir().unwrap();
    let present = dir.path().join("ironsan.toml");
    std::fs::write(&present, "").unwrap();
    let absent = dir.path().join("missing.toml");
    let flag = Path::new("/x/flag.toml");
    let env = std::ffi::OsStr::new("/x/env.toml");
    // --config wins over everything.
    assert_eq!(
        config_source(Some(flag), Some(env), true, &present),
        Ok(Source::Flag(flag.into()))
    );
    // Then IRONSAN_CONFIG, which conflicts with target flags.
    assert_eq!(
        config_source(None, Some(env), false, &present),
        Ok(Source::Env("/x/env.toml".into()))
    );
    let err = config_source(None, Some(env), true, &present).unwrap_err();
    assert!(err.contains("IRONSAN_CONFIG=/x/env.toml"), "{err}");
    // An empty variable counts as unset.
    assert_eq!(
        config_source(None, Some(std::ffi::OsStr::new("")), false, &present),
        Ok(Source::Default(present.clone()))
    );
    // Target flags beat the default file.
    assert_eq!(config_source(None, None, true, &present), Ok(Source::Flags));
    // No flags: the default file if it exists, else the embedded default.
    assert_eq!(
        config_source(None, None, false, &present),
        Ok(Source::Default(present.clone()))
    );
    assert_eq!(config_source(None, None, false, &absent), Ok(Source::Flags));
    assert_eq!(
        Source::Default(present.clone()).path(),
        Some(present.as_path())
    );
    assert_eq!(Source::Flags.path(), None);
    assert_eq!(DEFAULT_CONFIG_PATH, "/etc/ironsan/ironsan.toml");
}

#[test]
fn metrics_control_and_shutdown_grace_keys() {
    let base = "[[target]]\nname = \"iqn.2026-11.org.x:a\"\n[[target.lun]]\nspec = \"ram:1M\"\n";
    let plan = parse_file(base, Path::new("t.toml")).unwrap();
    assert_eq!(plan.metrics, None);
    assert_eq!(plan.control, None);
    assert_eq!(
        plan.limits.shutdown_grace,
        std::time::Duration::from_secs(10)
    );
    let text = format!(
        "metrics = \"127.0.0.1:9360\"\ncontrol = \"/run/x/control.sock\"\n{base}[limits]\nshutdown_grace = \"2500ms\"\n"
    );
    let plan = parse_file(&text, Path::new("t.toml")).unwrap();
    assert_eq!(plan.metrics, Some("127.0.0.1:9360".parse().unwrap()));
    assert_eq!(plan.control, Some(PathBuf::from("/run/x/control.sock")));
    assert_eq!(
        plan.limits.shutdown_grace,
        std::time::Duration::from_millis(2500)
    );
    let text = format!("{base}[limits]\nzero_copy_reads = \"off\"\n");
    let plan = parse_file(&text, Path::new("t.toml")).unwrap();
    assert_eq!(
        plan.limits.zero_copy_reads,
        ironsan_server::ZeroCopyReads::Off
    );
    let text = format!("{base}[limits]\nzero_copy_reads = \"mapped\"\n");
    let plan = parse_file(&text, Path::new("t.toml")).unwrap();
    assert_eq!(
        plan.limits.zero_copy_reads,
        ironsan_server::ZeroCopyReads::Mapped
    );
    let err = parse_file(
        &format!("{base}[limits]\nzero_copy_reads = \"always\"\n"),
        Path::new("t.toml"),
    )
    .unwrap_err();
    // The error carries the file and line as data, and says them first when printed.
    assert_eq!(err.at, Some((PathBuf::from("t.toml"), 6)), "{err}");
    assert!(
        err.message
            .contains("'always' is not one of auto, on, mapped, off"),
        "{err}"
    );
    assert!(
        err.to_string().starts_with("t.toml:6: zero_copy_reads: "),
        "{err}"
    );
    let text = format!("{base}[limits]\nio_engine = \"threads\"\n");
    let plan = parse_file(&text, Path::new("t.toml")).unwrap();
    assert_eq!(plan.limits.io_engine, ironsan_backend::IoEngine::Threads);
    let err = parse_file(
        &format!("{base}[limits]\nio_engine = \"aio\"\n"),
        Path::new("t.toml"),
    )
    .unwrap_err();
    assert_eq!(err.at, Some((PathBuf::from("t.toml"), 6)), "{err}");
    assert_eq!(
        err.message,
        "io_engine: 'aio': expected auto, uring or threads"
    );
    let text = format!("control = \"none\"\n{base}");
    let plan = parse_file(&text, Path::new("t.toml")).unwrap();
    assert_eq!(plan.control, Some(PathBuf::from("none")));
    // Errors name the file and line.
    for (text, line, what) in [
        (format!("metrics = \"localhost\"\n{base}"), 1, "metrics"),
        (format!("\ncontrol = \"\"\n{base}"), 2, "control"),
        (
            format!("{base}[limits]\nshutdown_grace = \"ten\"\n"),
            6,
            "shutdown_grace",
        ),
        (
            format!("{base}[limits]\nshutdown_grace = \"2d\"\n"),
            6,
            "shutdown_grace",
        ),
        (
            format!("{base}[limits]\nshutdown_grace = \"2h\"\n"),
            6,
            "shutdown_grace",
        ),
    ] {
        let err = parse_file(&text, Path::new("t.toml"))
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with(&format!("t.toml:{line}: ")) && err.contains(what),
            "{err}"
        );
    }
    assert_eq!(
        parse_duration("10s"),
        Some(std::time::Duration::from_secs(10))
    );
    assert_eq!(
        parse_duration("2m"),
        Some(std::time::Duration::from_secs(120))
    );
    assert_eq!(parse_duration("0s"), Some(std::time::Duration::ZERO));
    assert_eq!(parse_duration("10"), None);
    assert_eq!(parse_duration("s"), None);
}

#[test]
fn config_errors_name_file_and_line() {
    let text = "listen = [\"127.0.0.1:3260\"]\n\n[[target]]\nname = \"iqn.2026-11.org.x:a\"\n[[target.lun]]\nspec = \"ram:12Q\"\n";
    let err = parse_file(text, Path::new("t.toml"))
        .unwrap_err()
        .to_string();
    assert!(err.starts_with("t.toml:6: "), "{err}");
    let text = "listen = [\"nowhere\"]\n";
    assert!(parse_file(text, Path::new("t.toml"))
        .unwrap_err()
        .to_string()
        .starts_with("t.toml:1: "));
    let text = "[[target]]\nname = \"iqn.2026-11.org.x:a\"\nbogus = 1\n";
    let err = parse_file(text, Path::new("t.toml"))
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("t.toml:3: ") && err.contains("bogus"),
        "{err}"
    );
    let text = "[[target]]\nname = \"Not A Name\"\n[[target.lun]]\nspec = \"ram:1G\"\n";
    assert!(parse_file(text, Path::new("t.toml"))
        .unwrap_err()
        .to_string()
        .starts_with("t.toml:2: "));
}

#[test]
fn config_file_describes_several_targets_and_portals() {
    let text = r#"
listen = ["127.0.0.1:3260", "[::1]:3261"]
data_dir = "/srv/iscsi"
queue_depth = 64
[[target]]
name = "iqn.2026-11.org.x:a"
[[target.lun]]
backend = "file"
path = "a.img"
size = "10G"
direct = true
write_cache = true
[[target.lun]]
spec = "null:16T"
[[target]]
name = "iqn.2026-11.org.x:b"
[[target.lun]]
backend = "ram"
size = "1G"
block_size = 4096
"#;
    let plan = parse_file(text, Path::new("c.toml")).unwrap();
    assert_eq!(plan.listen().len(), 2);
    assert_eq!(plan.portal_groups[0].tag, 1);
    assert_eq!(plan.queue_depth, 64);
    assert_eq!(plan.targets.len(), 2);
    assert_eq!(
        plan.targets[0].luns[0].backing,
        Backing::File {
            path: "/srv/iscsi/a.img".into(),
            size: Some(10 << 30)
        }
    );
    assert!(plan.targets[0].luns[0].direct && plan.targets[0].luns[0].write_cache);
    assert_eq!(
        plan.targets[0].luns[1].backing,
        Backing::Null { size: 16 << 40 }
    );
    assert_eq!(plan.targets[1].luns[0].block_size, 4096);
}

#[test]
fn flags_default_to_the_embedded_lun() {
    let p = from_flags(
        &[],
        None,
        &[],
        Path::new("d"),
        false,
        false,
        &AuthFlags::default(),
    )
    .unwrap();
    assert_eq!(p.listen(), vec!["127.0.0.1:3260".parse().unwrap()]);
    assert_eq!(p.targets[0].name, DEFAULT_TARGET);
    assert_eq!(
        p.targets[0].luns[0].backing,
        Backing::File {
            path: "d/lun0.img".into(),
            size: Some(1 << 30)
        }
    );
    assert!(from_flags(
        &["x".into()],
        None,
        &[],
        Path::new("d"),
        false,
        false,
        &AuthFlags::default()
    )
    .unwrap_err()
    .starts_with("--listen"));
}

#[test]
fn config_file_access_control_and_limits() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("t.secret"), "target-secret-456\n").unwrap();
    std::env::set_var("IRONSAN_TEST_DISC_SECRET", "discovery-secret-1");
    let text = r#"
[limits]
max_connections = 64
max_sessions_per_initiator = 4
write_buffer_per_session = "128M"
[discovery]
chap = { user = "disc", secret_env = "IRONSAN_TEST_DISC_SECRET" }
acl = ["iqn.1993-08.org.debian:*"]
[[target]]
name = "iqn.2026-11.org.x:a"
acl = ["iqn.1993-08.org.debian:01:h1", "*@10.0.0.0/8"]
chap = { user = "h1", secret = "initiator-secret-1" }
mutual_chap = { user = "tgt", secret_file = "t.secret" }
[[target.lun]]
spec = "ram:1G"
"#;
    let plan = parse_file(text, &dir.path().join("c.toml")).unwrap();
    let a = &plan.targets[0].access;
    assert_eq!(a.acl.len(), 2);
    assert_eq!(
        a.chap.as_ref().unwrap().secret.expose(),
        b"initiator-secret-1"
    );
    assert_eq!(
        a.mutual_chap.as_ref().unwrap().secret.expose(),
        b"target-secret-456"
    );
    assert_eq!(
        plan.discovery.chap.as_ref().unwrap().secret.expose(),
        b"discovery-secret-1"
    );
    assert_eq!(plan.limits.max_connections, 64);
    assert_eq!(plan.limits.max_sessions_per_initiator, 4);
    assert_eq!(plan.limits.write_buffer_per_session, 128 << 20);
    assert_eq!(plan.limits.max_sessions, Limits::default().max_sessions);
    // Secrets never appear in the plan's Debug output.
    let dbg = format!("{plan:?}");
    assert!(!dbg.contains("initiator-secret") && !dbg.contains("target-secret"));
}

#[test]
fn access_control_errors_name_file_and_line() {
    let p = Path::new("c.toml");
    let base = "[[target]]\nname = \"iqn.2026-11.org.x:a\"\n[[target.lun]]\nspec = \"ram:1G\"\n";
    let cases = [
        // identical secrets in both directions
        ("[[target]]\nname = \"iqn.2026-11.org.x:a\"\nchap = { user = \"u\", secret = \"same-secret-123\" }\nmutual_chap = { user = \"t\", secret = \"same-secret-123\" }\n[[target.lun]]\nspec = \"ram:1G\"\n".to_string(), 4, "must differ"),
        ("[[target]]\nname = \"iqn.2026-11.org.x:a\"\nchap = { user = \"u\", secret = \"short\" }\n[[target.lun]]\nspec = \"ram:1G\"\n".to_string(), 3, "12 to 255"),
        ("[[target]]\nname = \"iqn.2026-11.org.x:a\"\nacl = [\"host*x\"]\n[[target.lun]]\nspec = \"ram:1G\"\n".to_string(), 3, "acl"),
        ("[[target]]\nname = \"iqn.2026-11.org.x:a\"\nchap = { user = \"u\", secret = \"a-long-secret-1\", secret_env = \"X\" }\n[[target.lun]]\nspec = \"ram:1G\"\n".to_string(), 3, "exactly one"),
        ("[[target]]\nname = \"iqn.2026-11.org.x:a\"\nchap = { user = \"u\", secret_env = \"IRONSAN_TEST_UNSET_VAR\" }\n[[target.lun]]\nspec = \"ram:1G\"\n".to_string(), 3, "not set"),
        (format!("[limits]\nmax_connections = 0\n{base}"), 2, "max_connections"),
        ("[[target]]\nname = \"iqn.2026-11.org.x:a\"\nerror_recovery_level = 3\n[[target.lun]]\nspec = \"ram:1G\"\n".to_string(), 3, "error_recovery_level must be between 0 and 2"),
        (format!("[limits]\nwrite_buffer_per_session = \"1M\"\n{base}"), 2, "write_buffer_per_session"),
        (format!("[discovery]\nmutual_chap = {{ user = \"t\", secret = \"a-long-secret-1\" }}\n{base}"), 2, "needs chap"),
    ];
    for (text, line, what) in cases {
        let err = parse_file(&text, p).unwrap_err().to_string();
        assert!(
            err.starts_with(&format!("c.toml:{line}: ")) && err.contains(what),
            "{err}\n---\n{text}"
        );
    }
}

#[test]
fn credential_flags_take_secrets_inline_from_files_or_the_environment() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("s");
    std::fs::write(&f, "file-secret-1234\r\n").unwrap();
    let c = parse_credential("--chap", "alice:inline-secret-1", None).unwrap();
    assert_eq!(
        (c.user.as_str(), c.secret.expose()),
        ("alice", &b"inline-secret-1"[..])
    );
    let c = parse_credential("--chap", &format!("alice:@{}", f.display()), None).unwrap();
    assert_eq!(c.secret.expose(), b"file-secret-1234");
    std::env::set_var("IRONSAN_TEST_FLAG_SECRET", "env-secret-12345");
    let c = parse_credential("--chap", "alice:env:IRONSAN_TEST_FLAG_SECRET", None).unwrap();
    assert_eq!(c.secret.expose(), b"env-secret-12345");
    // With --chap-secret-file the value is the user name, colons and all.
    let c = parse_credential("--chap", "iqn.1993-08.org.debian:01:h1", Some(&f)).unwrap();
    assert_eq!(c.user, "iqn.1993-08.org.debian:01:h1");
    for (v, what) in [
        ("alice", "USER:SECRET"),
        ("alice:short", "12 to 255"),
        (":long-enough-secret", "user name"),
        ("alice:env:IRONSAN_TEST_UNSET_VAR", "not set"),
        ("alice:@/nonexistent/secret", "cannot read"),
    ] {
        let e = parse_credential("--chap", v, None).unwrap_err();
        assert!(e.starts_with("--chap: ") && e.contains(what), "{v}: {e}");
    }
    let flags = AuthFlags {
        chap: Some("u:same-secret-1234".into()),
        mutual_chap: Some("t:same-secret-1234".into()),
        ..Default::default()
    };
    let e = from_flags(&[], None, &[], Path::new("d"), false, false, &flags).unwrap_err();
    assert!(
        e.starts_with("--mutual-chap: ") && e.contains("differ"),
        "{e}"
    );
    let flags = AuthFlags {
        acl: vec!["not-a-name".into()],
        ..Default::default()
    };
    let e = from_flags(&[], None, &[], Path::new("d"), false, false, &flags).unwrap_err();
    assert!(e.starts_with("--acl "), "{e}");
}

#[test]
fn rbd_specs_and_their_options_read_back_as_written() {
    let d = Path::new("/data");
    let l = parse_lun(
        "rbd:rbd/vm1,conf=/etc/ceph/c.conf,id=client.iscsi,timeout=7,shared",
        d,
    )
    .unwrap();
    let Backing::Rbd(r) = &l.backing else {
        panic!("{l:?}");
    };
    assert_eq!(
        (r.image_spec(), r.id.as_str(), r.timeout_secs, r.shared),
        ("rbd/vm1".to_string(), "iscsi", 7, true)
    );
    assert_eq!(r.conf.as_deref(), Some(Path::new("/etc/ceph/c.conf")));
    let spec = crate::reconcile::lun_spec(&l);
    assert_eq!(
        spec,
        "rbd:rbd/vm1,conf=/etc/ceph/c.conf,id=iscsi,timeout=7,shared"
    );
    assert_eq!(parse_lun(&spec, d).unwrap(), l);
    let plain = parse_lun("rbd:pool/ns/img", d).unwrap();
    assert!(
        matches!(&plain.backing, Backing::Rbd(r) if !r.shared && r.namespace.as_deref() == Some("ns"))
    );
    let e = parse_lun("ram:1G,shared", d).unwrap_err();
    assert!(e.contains("shared applies to rbd: LUNs only"), "{e}");
}

#[test]
fn a_cluster_node_from_the_file_and_the_flag() {
    let text = r#"listen = ["127.0.0.1:3260"]
[cluster]
node = 3
pool = "gw"
conf = "/etc/ceph/ceph.conf"
name = "gw3"
group = "east"
heartbeat = "1s"
lease = "4s"
[[target]]
name = "iqn.2026-11.org.x:a"
[[target.lun]]
spec = "ram:1M"
"#;
    let plan = parse_file(text, Path::new("t.toml")).unwrap();
    let c = plan.cluster.as_ref().unwrap();
    assert_eq!(
        (c.node, c.pool.as_str(), c.id.as_str(), c.name.as_str()),
        (3, "gw", "admin", "gw3")
    );
    assert_eq!(c.conf.as_deref(), Some(Path::new("/etc/ceph/ceph.conf")));
    assert_eq!(c.heartbeat, std::time::Duration::from_secs(1));
    assert_eq!(c.lease, std::time::Duration::from_secs(4));
    assert_eq!(c.group, "east");
    // `listen` is the node's portal group: tags are relative ports, unique in the cluster.
    assert_eq!(plan.portal_groups[0].tag, 3);
    // What `ctl save` writes reads back as the same node.
    let saved = format!(
        "{}\n[[target]]\nname = \"iqn.2026-11.org.x:a\"\n[[target.lun]]\nspec = \"ram:1M\"\n",
        cluster_toml(c).trim_start()
    );
    assert_eq!(
        parse_file(&saved, Path::new("s.toml"))
            .unwrap()
            .cluster
            .as_ref(),
        Some(c)
    );

    let bad = |from: &str, to: &str| {
        parse_file(&text.replace(from, to), Path::new("t.toml"))
            .unwrap_err()
            .to_string()
    };
    let e = bad("node = 3", "node = 0");
    assert!(
        e.starts_with("t.toml:3:") && e.contains("1 to 65535"),
        "{e}"
    );
    let e = bad("heartbeat = \"1s\"", "heartbeat = \"2h\"");
    assert!(
        e.starts_with("t.toml:8:") && e.contains("between 100ms and 60s"),
        "{e}"
    );
    // A lease that a peer's next answer could miss: refused, naming its line.
    let e = bad("lease = \"4s\"", "lease = \"2s\"");
    assert!(e.starts_with("t.toml:9:") && e.contains("too short"), "{e}");
    let e = bad("pool = \"gw\"\n", "");
    assert!(e.contains("pool"), "{e}");
    let e = bad(
        "spec = \"ram:1M\"\n",
        "spec = \"ram:1M\"\n[[target.alua_group]]\nid = 1\nportal_groups = [3]\n",
    );
    assert!(e.contains("leave out [[target.alua_group]]"), "{e}");

    let c = parse_cluster_flag("node=2,pool=rbd,id=gw,notify_timeout=3s").unwrap();
    assert_eq!((c.node, c.id.as_str()), (2, "gw"));
    assert_eq!(c.notify_timeout, std::time::Duration::from_secs(3));
    let plan = on_cluster(
        from_flags(
            &[],
            None,
            &[],
            Path::new("d"),
            false,
            false,
            &AuthFlags::default(),
        )
        .unwrap(),
        c,
    );
    assert_eq!(plan.portal_groups[0].tag, 2);
    for (flag, says) in [
        ("pool=rbd", "needs node=N"),
        ("node=0,pool=rbd", "1 to 65535"),
        ("node=1,pool=rbd,colour=blue", "unknown key 'colour'"),
        ("node=1", "pool"),
        ("node=1,pool=rbd,heartbeat=soon", "not a duration"),
        ("node=1,pool=rbd,heartbeat=2s,lease=3s", "too short"),
    ] {
        let e = parse_cluster_flag(flag).unwrap_err();
        assert!(e.contains(says), "{flag}: {e}");
    }
}
