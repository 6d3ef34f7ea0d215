#!/usr/bin/env python3
"""One guest TCP connection <-> one TCP connection to ironsan on the host.

QEMU's user-mode network runs this once per guest connection to the
guestfwd address (``guestfwd=tcp:10.0.2.100:3260-cmd:relay.py HOST PORT LOG``):
stdin/stdout is a socket carrying the guest's byte stream. A chardev target
(``...-tcp:127.0.0.1:PORT``) would not do: QEMU connects it once at start-up
(long before the guest logs in, so ironsan's login timeout closes it) and
funnels every guest connection through that one host connection, so the
discovery session and the login session could not both work.

Half-closes are passed on in both directions; the relay ends when both
directions are closed, or after --max-seconds whatever happens.
"""

import os
import selectors
import signal
import socket
import sys
import time


def main() -> int:
    if len(sys.argv) < 3:
        print("usage: relay.py HOST PORT [LOGFILE] [MAX_SECONDS]", file=sys.stderr)
        return 2
    host, port = sys.argv[1], int(sys.argv[2])
    logpath = sys.argv[3] if len(sys.argv) > 3 else None
    max_seconds = int(sys.argv[4]) if len(sys.argv) > 4 else 900
    signal.alarm(max_seconds)  # bounded lifetime: SIGALRM ends the process

    start = time.monotonic()
    counts = {"guest->target": 0, "target->guest": 0}

    def log(msg: str) -> None:
        if logpath:
            with open(logpath, "a", encoding="utf-8") as f:
                f.write(f"relay pid {os.getpid()} +{time.monotonic() - start:.3f}s: {msg}\n")

    # QEMU gives this process the guest's socket as stdin, stdout and stderr: nothing may be
    # printed (a traceback would reach the guest as iSCSI bytes). Errors go to the log.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    guest = socket.socket(fileno=os.dup(0))
    try:
        target = socket.create_connection((host, port), timeout=10)
    except OSError as e:
        log(f"cannot connect to {host}:{port}: {e}; closing the guest's connection")
        guest.close()
        return 1
    target.settimeout(None)
    target.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    log(f"connected to {host}:{port}")

    sel = selectors.DefaultSelector()
    peer = {guest: target, target: guest}
    names = {guest: "guest->target", target: "target->guest"}
    open_dirs = {guest, target}  # sources still delivering data
    for s in open_dirs:
        sel.register(s, selectors.EVENT_READ)

    while open_dirs:
        for key, _ in sel.select():
            src = key.fileobj
            try:
                data = src.recv(1 << 16)
            except OSError as e:
                log(f"{names[src]} recv error: {e}")
                data = b""
            if data:
                try:
                    peer[src].sendall(data)
                    counts[names[src]] += len(data)
                    continue
                except OSError as e:
                    log(f"{names[src]} send error: {e}")
            # EOF (or error) from src: pass the half-close on.
            sel.unregister(src)
            open_dirs.discard(src)
            try:
                peer[src].shutdown(socket.SHUT_WR)
            except OSError:
                pass
            log(f"{names[src]} closed after {counts[names[src]]} bytes")
    guest.close()
    target.close()
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
