#!/usr/bin/env python3
"""Log in idle iSCSI sessions and hold them open (used by bench/run.sh).

    idle-sessions.py HOST PORT TARGET_IQN [--sessions N] [--conns C]

Opens N sessions of C connections each (--connect-only: N bare TCP
connections, no login) (C > 1 adds connections to the same
session: same ISID, the TSIH the target assigned, CIDs 0..C-1, which needs
MaxConnections >= C to have been agreed). Login is one operational stage
straight to full feature phase, as libiscsi does without CHAP, so the target
must not require authentication.

Once every connection is in full feature phase it prints "ready N C" on
stdout, then serves NOP-In pings (answering with NOP-Out, so a target with a
NOP timeout keeps the session) until stdin reaches EOF or it gets SIGTERM/
SIGINT; then it closes the sockets (no Logout: the bench measures the target
while they are open, not how it handles logout). One Python process holds all
sessions, so unlike N iscsi-perf processes the client side stays small.
Failures go to stderr with exit status 1.
"""
import argparse
import concurrent.futures
import os
import selectors
import signal
import socket
import struct
import sys

RESERVED = 0xFFFFFFFF


def pdu(op, flags, data=b"", rest=b""):
    """BHS: byte0 opcode, byte1 flags, then bytes 2..47 given in `rest` (with
    TotalAHSLength/DataSegmentLength filled in here), then padded data."""
    assert len(rest) == 46
    dlen = len(data)
    hdr = bytes([op, flags]) + rest[:2] + bytes([0]) + dlen.to_bytes(3, "big") + rest[6:]
    return hdr + data + b"\0" * (-dlen % 4)


def recv_exact(sock, n):
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("connection closed by the target")
        buf += chunk
    return bytes(buf)


def recv_pdu(sock):
    bhs = recv_exact(sock, 48)
    ahs = bhs[4] * 4
    dlen = int.from_bytes(bhs[5:8], "big")
    rest = recv_exact(sock, ahs + dlen + (-dlen % 4))
    return bhs, rest[ahs:ahs + dlen]


def kv(pairs):
    return b"".join(f"{k}={v}".encode() + b"\0" for k, v in pairs)


def parse_kv(data):
    out = {}
    for item in data.split(b"\0"):
        if b"=" in item:
            k, v = item.split(b"=", 1)
            out[k.decode()] = v.decode()
    return out


class Conn:
    def __init__(self, host, port, isid, tsih, cid, iname, tname, conns):
        self.sock = socket.create_connection((host, port), timeout=120)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.isid, self.tsih, self.cid = isid, tsih, cid
        self.itt = 1
        self.cmdsn = 1
        self.exp_statsn = 0
        self.agreed = {}
        # One operational stage straight to full feature phase (what libiscsi does when no
        # authentication is configured; RFC 7143 allows skipping the security stage).
        op = [("InitiatorName", iname), ("TargetName", tname), ("SessionType", "Normal"),
              ("HeaderDigest", "None"), ("DataDigest", "None")]
        if conns > 1:
            op.append(("MaxConnections", str(conns)))
        self.stage(1, 3, op)
        self.sock.settimeout(None)
        self.sock.setblocking(False)
        self.rx = bytearray()

    def stage(self, csg, nsg, pairs):
        data = kv(pairs)
        for _ in range(8):
            flags = 0x80 | (csg << 2) | nsg  # T=1
            rest = (bytes(2) + bytes(4) + self.isid + struct.pack(">HIHH", self.tsih, self.itt, self.cid, 0)
                    + struct.pack(">II", self.cmdsn, self.exp_statsn) + bytes(16))
            self.sock.sendall(pdu(0x43, flags, data, rest))  # Login Request, immediate
            bhs, rdata = recv_pdu(self.sock)
            if bhs[0] & 0x3F != 0x23:
                raise RuntimeError(f"expected a Login Response, got opcode {bhs[0]:#x}")
            cls, det = bhs[36], bhs[37]
            if cls != 0:
                raise RuntimeError(f"login refused: status {cls:02x}{det:02x} {parse_kv(rdata)}")
            self.agreed.update(parse_kv(rdata))
            self.tsih = int.from_bytes(bhs[14:16], "big")
            self.exp_statsn = int.from_bytes(bhs[24:28], "big") + 1
            self.cmdsn = int.from_bytes(bhs[28:32], "big")  # ExpCmdSN
            if bhs[1] & 0x80 and (bhs[1] & 3) == nsg:
                return
            data = b""  # the target wants another round of this stage
        raise RuntimeError("login did not complete")

    def on_readable(self):
        chunk = self.sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"target closed connection (tsih {self.tsih}, cid {self.cid})")
        self.rx += chunk
        while len(self.rx) >= 48:
            dlen = int.from_bytes(self.rx[5:8], "big")
            total = 48 + self.rx[4] * 4 + dlen + (-dlen % 4)
            if len(self.rx) < total:
                break
            bhs = bytes(self.rx[:48])
            del self.rx[:total]
            op = bhs[0] & 0x3F
            statsn = int.from_bytes(bhs[24:28], "big")
            if op == 0x20:  # NOP-In
                ttt = int.from_bytes(bhs[20:24], "big")
                if ttt != RESERVED:  # a ping: answer it
                    rest = (bytes(2) + bytes(4) + bhs[8:16]
                            + struct.pack(">IIII", RESERVED, ttt, self.cmdsn, statsn + 1) + bytes(16))
                    self.sock.setblocking(True)
                    self.sock.sendall(pdu(0x40, 0x80, b"", rest))  # NOP-Out, immediate, F
                    self.sock.setblocking(False)
            elif op == 0x32:  # Async message: a logout request or similar; just follow StatSN
                self.exp_statsn = statsn + 1
            self.cmdsn = max(self.cmdsn, int.from_bytes(bhs[28:32], "big"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("host")
    ap.add_argument("port", type=int)
    ap.add_argument("target")
    ap.add_argument("--sessions", type=int, default=100)
    ap.add_argument("--conns", type=int, default=1)
    ap.add_argument("--connect-only", action="store_true",
                    help="open N TCP connections without logging in (cost of a bare connection)")
    ap.add_argument("--initiator", default="iqn.2026-11.org.ironsan:bench-idle")
    a = ap.parse_args()

    conns = []
    if a.connect_only:
        socks = [socket.create_connection((a.host, a.port), timeout=10) for _ in range(a.sessions)]
        print(f"ready {a.sessions} 0", flush=True)
        sys.stdin.read()
        del socks
        return 0
    def open_session(s):
        isid = bytes([0x80, 0x00, 0x42]) + (0x100000 + s).to_bytes(3, "big")
        # One initiator name per session: a target may cap sessions per initiator
        # (ironsan: 32), and 100 idle sessions stand for 100 hosts.
        iname = f"{a.initiator}-{s}"
        first = Conn(a.host, a.port, isid, 0, 0, iname, a.target, a.conns)
        out = [first]
        if a.conns > 1:
            agreed = int(first.agreed.get("MaxConnections", "1"))
            if agreed < a.conns:
                raise RuntimeError(f"target agreed MaxConnections={agreed} < {a.conns}")
        for cid in range(1, a.conns):
            out.append(Conn(a.host, a.port, isid, first.tsih, cid, iname, a.target, a.conns))
        return out

    # Logins in parallel: some targets (istgt) take about a second per login.
    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        for group in pool.map(open_session, range(a.sessions)):
            conns.extend(group)

    print(f"ready {a.sessions} {a.conns}", flush=True)
    sel = selectors.DefaultSelector()
    for c in conns:
        sel.register(c.sock, selectors.EVENT_READ, c)
    stop_r, stop_w = os.pipe()
    signal.signal(signal.SIGTERM, lambda *_: os.write(stop_w, b"x"))
    signal.signal(signal.SIGINT, lambda *_: os.write(stop_w, b"x"))
    sel.register(stop_r, selectors.EVENT_READ, "stop")
    sel.register(sys.stdin, selectors.EVENT_READ, "stdin")
    while True:
        for key, _ in sel.select():
            if key.data == "stop":
                return 0
            if key.data == "stdin":
                if not os.read(sys.stdin.fileno(), 4096):
                    return 0
                continue
            key.data.on_readable()


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as e:  # noqa: BLE001 - report any failure in one line
        print(f"idle-sessions: {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(1)
