//! The hand-written librados/librbd declarations of `ffi.rs` checked against the installed
//! headers (librados-dev, librbd-dev): every entry point of `struct Api` as a C prototype, the
//! `#[repr(C)]` structs' sizes and field offsets, and the constants. The prototypes are read
//! from ffi.rs's own text, so an entry point added there is checked without a change here;
//! the C compiler judges them (`__builtin_types_compatible_p`, which also tells `const char *`
//! from `char *`).

use super::{ConfigOption, NotifyAck, NotifyTimeout};
use std::io::Write;
use std::mem::{offset_of, size_of};
use std::process::{Command, Stdio};

const SOURCE: &str = include_str!("../ffi.rs");
const HEADERS: [&str; 2] = ["/usr/include/rados/librados.h", "/usr/include/rbd/librbd.h"];

/// Split `s` at the commas outside parentheses.
fn split_top(s: &str) -> Vec<&str> {
    let (mut depth, mut start, mut out) = (0i32, 0, Vec::new());
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                out.push(s[start..i].trim());
                start = i + 1;
            }
            _ => {}
        }
    }
    let last = s[start..].trim();
    if !last.is_empty() {
        out.push(last);
    }
    out
}

/// `extern "C" fn(ARGS) -> RET` (with or without `unsafe`) as (ARGS, RET).
fn fn_parts(t: &str) -> Option<(&str, &str)> {
    let t = t.trim().trim_start_matches("unsafe").trim();
    let t = t.strip_prefix("extern \"C\" fn(")?;
    let mut depth = 1;
    let close = t.char_indices().find_map(|(i, c)| {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            _ => {}
        }
        (depth == 0).then_some(i)
    })?;
    let ret = t[close + 1..]
        .trim()
        .strip_prefix("->")
        .map_or("", str::trim);
    Some((&t[..close], ret))
}

/// The type aliases of ffi.rs (`type X = ...;`).
fn aliases() -> Vec<(String, String)> {
    SOURCE
        .split(';')
        .filter_map(|item| {
            let item = item.trim();
            let line = item
                .lines()
                .rev()
                .find(|l| l.trim_start().starts_with("type "))?;
            let start = item.find(line)?;
            let decl = item[start..].trim().strip_prefix("type ")?;
            let (name, ty) = decl.split_once('=')?;
            Some((
                name.trim().to_string(),
                ty.split_whitespace().collect::<Vec<_>>().join(" "),
            ))
        })
        .collect()
}

/// A Rust type of the declarations as a C type name.
fn c_type(t: &str, aliases: &[(String, String)]) -> String {
    let t = t.trim();
    if let Some(inner) = t.strip_prefix("*mut ") {
        return format!("{} *", c_type(inner, aliases));
    }
    if let Some(inner) = t.strip_prefix("*const ") {
        return format!("const {} *", c_type(inner, aliases));
    }
    if let Some((args, ret)) = fn_parts(t) {
        return c_fn_pointer(args, ret, aliases);
    }
    let plain = match t {
        "c_int" => "int",
        "c_char" => "char",
        "c_void" => "void",
        "u8" => "uint8_t",
        "u32" => "uint32_t",
        "u64" => "uint64_t",
        "i64" => "int64_t",
        "usize" => "size_t",
        "isize" => "ssize_t",
        "libc::iovec" => "struct iovec",
        "libc::time_t" => "time_t",
        "libc::timespec" => "struct timespec",
        "NotifyAck" => "struct notify_ack_t",
        "NotifyTimeout" => "struct notify_timeout_t",
        "ConfigOption" => "rbd_config_option_t",
        "LockMode" => "rbd_lock_mode_t",
        other => {
            // Handles and callbacks: what their alias stands for, structurally.
            return match aliases.iter().find(|(n, _)| n == other) {
                Some((_, ty)) => c_type(ty, aliases),
                None => panic!("headers check: no C type for the Rust type {other:?}"),
            };
        }
    };
    plain.to_string()
}

fn c_fn_pointer(args: &str, ret: &str, aliases: &[(String, String)]) -> String {
    let args: Vec<String> = split_top(args).iter().map(|a| c_type(a, aliases)).collect();
    let ret = if ret.is_empty() {
        "void".to_string()
    } else {
        c_type(ret, aliases)
    };
    let args = if args.is_empty() {
        "void".to_string()
    } else {
        args.join(", ")
    };
    format!("{ret} (*)({args})")
}

/// The entry points of `struct Api`: (name, C function pointer type).
fn entry_points() -> Vec<(String, String)> {
    let aliases = aliases();
    let body = SOURCE
        .split_once("\nstruct Api {")
        .and_then(|(_, rest)| rest.split_once("\n}\n"))
        .map(|(body, _)| body)
        .expect("struct Api in ffi.rs");
    split_top(body)
        .into_iter()
        .map(|field| {
            let (name, ty) = field.split_once(':').expect("name: type");
            let ty = ty.split_whitespace().collect::<Vec<_>>().join(" ");
            let (args, ret) = fn_parts(&ty).unwrap_or_else(|| panic!("{name}: not a fn: {ty}"));
            (name.trim().to_string(), c_fn_pointer(args, ret, &aliases))
        })
        .collect()
}

/// The C text that compiles only if every declaration matches the headers.
fn c_check(extra: &str) -> String {
    let mut c = String::from(
        "#include <stddef.h>\n#include <stdint.h>\n#include <sys/types.h>\n#include <sys/uio.h>\n\
         #include <rados/librados.h>\n#include <rbd/librbd.h>\n#include <rbd/features.h>\n\
         #define SAME(f, t) _Static_assert(__builtin_types_compatible_p(__typeof__(&f), t), #f \" is not \" #t)\n\
         #define EQ(a, b) _Static_assert((a) == (b), #a \" != \" #b)\n",
    );
    for (name, ty) in entry_points() {
        c.push_str(&format!("SAME({name}, {ty});\n"));
    }
    for (c_name, size, fields) in [
        (
            "struct notify_ack_t",
            size_of::<NotifyAck>(),
            vec![
                ("notifier_id", offset_of!(NotifyAck, notifier_id)),
                ("cookie", offset_of!(NotifyAck, cookie)),
                ("payload", offset_of!(NotifyAck, payload)),
                ("payload_len", offset_of!(NotifyAck, payload_len)),
            ],
        ),
        (
            "struct notify_timeout_t",
            size_of::<NotifyTimeout>(),
            vec![
                ("notifier_id", offset_of!(NotifyTimeout, notifier_id)),
                ("cookie", offset_of!(NotifyTimeout, cookie)),
            ],
        ),
        (
            "rbd_config_option_t",
            size_of::<ConfigOption>(),
            vec![
                ("name", offset_of!(ConfigOption, name)),
                ("value", offset_of!(ConfigOption, value)),
                ("source", offset_of!(ConfigOption, source)),
            ],
        ),
    ] {
        c.push_str(&format!("EQ(sizeof({c_name}), {size});\n"));
        for (f, off) in fields {
            c.push_str(&format!("EQ(offsetof({c_name}, {f}), {off});\n"));
        }
    }
    for (c_name, v) in [
        ("LIBRADOS_CMPXATTR_OP_EQ", u64::from(super::CMPXATTR_EQ)),
        (
            "RBD_LOCK_MODE_EXCLUSIVE",
            u64::from(super::LOCK_MODE_EXCLUSIVE),
        ),
        (
            "RBD_WRITE_ZEROES_FLAG_THICK_PROVISION",
            super::ZEROES_THICK as u64,
        ),
        ("RBD_FEATURE_EXCLUSIVE_LOCK", super::FEATURE_EXCLUSIVE_LOCK),
    ] {
        c.push_str(&format!("EQ({c_name}, {v}ULL);\n"));
    }
    for (bit, name) in super::FEATURES_NEEDING_LOCK {
        let c_name = format!("RBD_FEATURE_{}", name.replace('-', "_").to_uppercase());
        c.push_str(&format!("EQ({c_name}, {bit}ULL);\n"));
    }
    c.push_str(extra);
    c
}

/// Compile `text` (syntax and static assertions only); the compiler's messages on failure.
fn compile(text: &str) -> Result<(), String> {
    let mut child = Command::new("cc")
        .args(["-std=gnu11", "-fsyntax-only", "-x", "c", "-"])
        .stdin(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cc: {e}"))?;
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(text.as_bytes())
        .map_err(|e| format!("cc stdin: {e}"))?;
    let out = child.wait_with_output().map_err(|e| format!("cc: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

#[test]
fn the_declarations_match_the_installed_librados_and_librbd_headers() {
    if let Some(h) = HEADERS.iter().find(|h| !std::path::Path::new(h).exists()) {
        ironsan_testkit::skip(format!(
            "{h} missing (apt-get install librados-dev librbd-dev; scripts/install-deps.sh does)"
        ));
        return;
    }
    let points = entry_points();
    assert!(
        points.len() >= 40,
        "only {} entry points parsed from struct Api",
        points.len()
    );
    let text = c_check("");
    if let Err(e) = compile(&text) {
        panic!("ffi.rs disagrees with the headers:\n{e}\n---- generated C ----\n{text}");
    }
    // The check can fail: a wrong prototype, a wrong size and a wrong constant are refused.
    for wrong in [
        "SAME(rados_connect, int (*)(rados_t, int));\n",
        "SAME(rados_blocklist_add, int (*)(rados_t, const char *, uint32_t));\n",
        "EQ(sizeof(struct notify_ack_t), 24);\n",
        "EQ(RBD_LOCK_MODE_EXCLUSIVE, 1ULL);\n",
    ] {
        assert!(compile(&c_check(wrong)).is_err(), "not refused: {wrong}");
    }
}
