"""What runs on this host for runner-meter: the user unit's state, its main process, and who listens on its port.

Read-only; prints one JSON object. Run by ansible/roles/meters (sidecar.yml) before and after starting the unit,
so READY is decided from what is running, not from what a run changed. Uses only the standard library and
/proc: a LISTEN socket's inode (/proc/net/tcp*) is matched to the processes whose fds this user may read, and
the socket's owner uid is named where its process is not visible (another user's).

usage: python3 sidecar_state.py UNIT HOST PORT ENV_KEY
"""

import json
import os
import pwd
import socket
import subprocess
import sys

PROPS = ("LoadState", "ActiveState", "SubState", "MainPID", "NeedDaemonReload", "UnitFileState", "NRestarts",
         "Result")


def unit_props(unit):
    p = subprocess.run(["systemctl", "--user", "show", unit] + ["--property=" + k for k in PROPS],
                       capture_output=True, text=True, timeout=20)
    props = dict(line.split("=", 1) for line in p.stdout.splitlines() if "=" in line)
    props["error"] = p.stderr.strip()[:300] if p.returncode else ""
    return props


def read(path, mode="r"):
    try:
        with open(path, mode) as f:
            return f.read()
    except OSError:
        return None


def process(pid):
    cmdline = read(f"/proc/{pid}/cmdline", "rb")
    if cmdline is None:
        return None
    environ = read(f"/proc/{pid}/environ", "rb") or b""
    env = dict(e.split(b"=", 1) for e in environ.split(b"\0") if b"=" in e)
    return {"pid": pid, "cmdline": [a.decode(errors="replace") for a in cmdline.split(b"\0") if a],
            "env": {k.decode(errors="replace"): v.decode(errors="replace") for k, v in env.items()}}


def descendants(pid):
    children = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            stat = read(f"/proc/{d}/stat") or ""
            fields = stat.rsplit(")", 1)[-1].split()
            if len(fields) > 1:
                children.setdefault(int(fields[1]), []).append(int(d))
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        if p not in out:
            out.add(p)
            todo.extend(children.get(p, []))
    return out


def hex_addr(h):
    raw = bytes.fromhex(h)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    # tcp6: four 32-bit words, each in host (little-endian) order.
    return socket.inet_ntop(socket.AF_INET6, b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))


def listeners(port):
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in (read(table) or "").splitlines()[1:]:
            f = line.split()
            if len(f) < 10 or f[3] != "0A":  # 0A: LISTEN
                continue
            addr, hport = f[1].rsplit(":", 1)
            if int(hport, 16) == port:
                out.append({"addr": hex_addr(addr), "uid": int(f[7]), "inode": f[9]})
    return out


def socket_pids():
    pids = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{d}/fd")
        except OSError:
            continue  # another user's process: its fds are not ours to read
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{d}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                pids.setdefault(link[8:-1], set()).add(int(d))
    return pids


def main():
    unit, host, port, env_key = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    props = unit_props(unit)
    main_pid = int(props.get("MainPID") or 0)
    proc = process(main_pid) if main_pid > 0 else None
    ours = descendants(main_pid) if proc else set()
    try:
        wanted = {ai[4][0] for ai in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)}
    except OSError:
        wanted = {host}
    wanted |= {"0.0.0.0", "::"}  # a wildcard listener answers on every address
    by_inode = socket_pids()
    found = []
    for sock in listeners(port):
        if sock["addr"] not in wanted:
            continue
        pids = sorted(by_inode.get(sock["inode"], ()))
        try:
            user = pwd.getpwuid(sock["uid"]).pw_name
        except KeyError:
            user = str(sock["uid"])
        procs = []
        for pid in pids:
            comm = (read(f"/proc/{pid}/comm") or "?").strip()
            args = " ".join((process(pid) or {}).get("cmdline", []))[:160]
            procs.append(f"pid {pid} ({comm}: {args})")
        found.append({"addr": sock["addr"], "uid": sock["uid"], "user": user, "procs": procs,
                      "ours": bool(ours) and bool(set(pids) & ours)})
    foreign = [f"{s['addr']}:{port} is held by "
               + (", ".join(s["procs"]) + f" of user {s['user']}" if s["procs"]
                  else f"a process of user {s['user']} (uid {s['uid']}) this user cannot see")
               for s in found if not s["ours"]]
    print(json.dumps({
        "unit": props,
        "main": {"pid": main_pid, "cmdline": proc["cmdline"], "build": proc["env"].get(env_key, "")} if proc else None,
        "listening": any(s["ours"] for s in found),
        "foreign": foreign,
    }))


if __name__ == "__main__":
    main()
