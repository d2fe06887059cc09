"""Startup hook of the project's venvs (``.venv/<base>/``): one ninja, and no hang on a dead build's lock.

``python3 dev.py setup`` copies this file into the venv's site-packages with a ``zero3muon_venv.pth``
that calls ``startup()``, so it runs in every Python of the venv: ``dev.py test/demo/bench``, the
examples, ``.venv/<base>/bin/torchrun`` / ``deepspeed`` / ``accelerate`` and an activated venv alike.
It is this project's tooling, not part of DeepSpeed (the wheel does not contain it). It does two
things, in microseconds when there is nothing to do; ``ZERO3MUON_VENV_HOOK=0`` turns it off.

1. **One ninja.** torch JIT-builds DeepSpeed's ops by running ``ninja`` from ``PATH``, and ninja
   1.11 (a system one) and 1.13 (the venv's, requirements/dev.txt) do not read each other's
   ``.ninja_log`` (v5 and v7): a build dir last built by the other version is rebuilt from scratch,
   minutes per op. Setup builds with the venv's ninja (its ``bin/`` first on ``PATH``), and here,
   if the first ``ninja`` on ``PATH`` is not the venv's, ``<venv>/ninja-bin`` (a directory holding
   only a link to the venv's ninja) is put first, so nothing else on ``PATH`` changes.

2. **Locks of dead builds.** torch's ``FileBaton`` guards each op's build dir with an empty file
   ``<extensions dir>/<op>/lock``, created with ``O_CREAT|O_EXCL`` and kept open by the building
   process until the build ends (then closed and removed). A process killed meanwhile leaves it
   behind, and every later load of that op waits for it forever, silently. The file holds no PID,
   so the owner-gone rule is: **no process has the file open and no ``ninja`` runs in its
   directory** (the holder keeps its descriptor open for the whole build; a killed Python's ninja
   may go on building as an orphan), seen twice ``RECHECK_S`` apart with the same inode (a release
   closes the file just before removing it). Such a lock is removed, with one line on stderr. While
   only an orphaned ninja runs there, we wait for it to end, saying so. A lock that is held is left
   alone (a load of that op waits until that build ends; ``dev.py`` names the holder).

   Limits: the test reads ``/proc`` (Linux). Where it cannot decide, it warns naming the file and
   removes nothing (``dev.py`` stops instead): without ``/proc``; for a lock owned by another user
   (their processes' descriptors are not readable) unless running as root; on a network
   filesystem (nfs, lustre, ...: a process on another host is invisible). A process in another PID
   namespace (another container) sharing the directory is invisible too. Only the directory this
   process's torch will use is checked: ``$TORCH_EXTENSIONS_DIR``, else torch's default
   ``$XDG_CACHE_HOME/torch_extensions/py<XY>_*`` (``~/.cache``). A build whose owner dies after
   this check (during this run) is not covered.

Stdlib only, and for Python >= 3.9: ``dev.py`` imports it with the system Python too.
"""

import os
import sys

ENV_SWITCH = "ZERO3MUON_VENV_HOOK"
NINJA_DIR = "ninja-bin"  # under the venv: a link to <venv>/bin/ninja, nothing else
RECHECK_S = 0.5  # a lock seen without holder is looked at again after this long
WAIT_POLL_S = 2.0
NETWORK_FS = frozenset(("nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "beegfs", "ceph", "glusterfs",
                        "fuse.sshfs", "fuse.glusterfs", "fuse.ceph", "fuse.gcsfuse", "9p", "afs", "panfs", "orangefs"))

# lock_state()'s verdicts
GONE, STALE, HELD, ORPHAN_BUILD, UNKNOWN = "gone", "stale", "held", "orphan-build", "unknown"


def _say(msg):
    try:
        sys.stderr.write(f"[zero3muon] {msg}\n")
        sys.stderr.flush()
    except Exception:
        pass


# --------------------------------------------------------------------------- ninja


def first_on_path(name, path):
    """The first executable ``name`` in the ``os.pathsep``-separated ``path``, or None."""
    for d in (path or "").split(os.pathsep):
        if d:
            candidate = os.path.join(d, name)
            if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
                return candidate
    return None


def same_file(a, b):
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def path_with_venv_ninja(prefix, path):
    """``path`` with ``<prefix>/ninja-bin`` first if the first ``ninja`` on it is not the venv's
    ``<prefix>/bin/ninja``; ``path`` unchanged when it is, or when the venv has no ninja or no
    ninja-bin."""
    venv_ninja = os.path.join(prefix, "bin", "ninja")
    ninja_dir = os.path.join(prefix, NINJA_DIR)
    if not os.path.isfile(venv_ninja) or not os.path.isfile(os.path.join(ninja_dir, "ninja")):
        return path
    found = first_on_path("ninja", path)
    if found is not None and same_file(found, venv_ninja):
        return path
    return ninja_dir + (os.pathsep + path if path else "")


def make_ninja_dir(prefix):
    """Create ``<prefix>/ninja-bin/ninja``, a link to ``<prefix>/bin/ninja`` (``dev.py setup``).
    Returns its path, or None if the venv has no ninja."""
    venv_ninja = os.path.join(prefix, "bin", "ninja")
    if not os.path.isfile(venv_ninja):
        return None
    ninja_dir = os.path.join(prefix, NINJA_DIR)
    os.makedirs(ninja_dir, exist_ok=True)
    link = os.path.join(ninja_dir, "ninja")
    if not (os.path.islink(link) and same_file(link, venv_ninja)):
        if os.path.lexists(link):
            os.remove(link)
        os.symlink(os.path.join("..", "bin", "ninja"), link)
    return link


# --------------------------------------------------------------------------- locks


def extension_dirs(environ=None, version=None):
    """The directories whose ``<op>/lock`` this process's torch would wait on."""
    environ = os.environ if environ is None else environ
    explicit = environ.get("TORCH_EXTENSIONS_DIR")
    if explicit:
        return [explicit]
    cache = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    root = os.path.join(cache, "torch_extensions")
    major, minor = version or sys.version_info[:2]
    tag = f"py{major}{minor}{getattr(sys, 'abiflags', '')}_"
    try:
        return [os.path.join(root, d) for d in sorted(os.listdir(root)) if d.startswith(tag)]
    except OSError:
        return []


def find_locks(dirs):
    """``<dir>/<op>/lock`` files that exist under ``dirs``."""
    out = []
    for d in dirs:
        try:
            ops = sorted(os.listdir(d))
        except OSError:
            continue
        for op in ops:
            lock = os.path.join(d, op, "lock")
            if os.path.lexists(lock):
                out.append(lock)
    return out


def filesystem_type(path, mounts="/proc/self/mounts"):
    """The type of the filesystem ``path`` lies on (longest mount point that contains it), or None."""
    path = os.path.realpath(path)
    best, fstype = "", None
    try:
        with open(mounts) as f:
            for line in f:
                fields = line.split()
                if len(fields) < 3:
                    continue
                point = fields[1].replace("\\040", " ")
                inside = path == point or path.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, fstype = point, fields[2]
    except OSError:
        return None
    return fstype


def _pids(proc):
    try:
        return [int(p) for p in os.listdir(proc) if p.isdigit()]
    except OSError:
        return []


def holders(lock, proc="/proc", own_pid=None):
    """(pids that have ``lock`` open, pids of ``ninja`` processes whose working directory is the
    lock's directory), from ``proc``; our own process is left out."""
    own_pid = os.getpid() if own_pid is None else own_pid
    real_lock = os.path.realpath(lock)
    real_dir = os.path.dirname(real_lock)
    openers, builders = [], []
    for pid in _pids(proc):
        if pid == own_pid:
            continue
        base = os.path.join(proc, str(pid))
        try:
            fds = os.listdir(os.path.join(base, "fd"))
        except OSError:  # gone, or not ours to read
            fds = []
        for fd in fds:
            try:
                target = os.readlink(os.path.join(base, "fd", fd))
            except OSError:
                continue
            if target == real_lock:
                openers.append(pid)
                break
        try:
            cwd = os.readlink(os.path.join(base, "cwd"))
            with open(os.path.join(base, "comm")) as f:
                comm = f.read().strip()
        except OSError:
            continue
        if cwd == real_dir and comm.startswith("ninja"):
            builders.append(pid)
    return openers, builders


def undecidable(lock, proc="/proc", mounts="/proc/self/mounts", euid=None):
    """Why the owner-gone test cannot be trusted for ``lock`` here, or None if it can."""
    if not os.path.isdir(os.path.join(proc, "self", "fd")):
        return f"no {proc} to see which processes hold it"
    euid = os.geteuid() if euid is None else euid
    try:
        st = os.lstat(lock)
    except OSError:
        return None
    if euid != 0 and st.st_uid != euid:
        return f"it belongs to user id {st.st_uid}, whose processes this user cannot inspect"
    fstype = filesystem_type(lock, mounts)
    if fstype in NETWORK_FS:
        return f"it lies on a {fstype} filesystem, where a process on another host may hold it"
    return None


def _inode(path):
    try:
        st = os.lstat(path)
        return (st.st_dev, st.st_ino)
    except OSError:
        return None


def lock_state(lock, proc="/proc", mounts="/proc/self/mounts", euid=None, recheck_s=RECHECK_S, sleep=None):
    """(verdict, detail) for ``lock``: GONE (no such file), HELD (pids that have it open), ORPHAN_BUILD
    (pids of a ninja still running in its directory while nobody holds the lock), STALE (no holder,
    twice ``recheck_s`` apart, same inode; the detail is that inode) or UNKNOWN (the reason the test
    cannot decide)."""
    inode = _inode(lock)
    if inode is None:
        return GONE, None
    reason = undecidable(lock, proc, mounts, euid)
    if reason is not None:
        return UNKNOWN, reason
    for attempt in range(2):
        openers, builders = holders(lock, proc)
        if openers:
            return HELD, openers
        if builders:
            return ORPHAN_BUILD, builders
        if attempt == 0:
            if sleep is None:
                import time
                sleep = time.sleep
            sleep(recheck_s)
            now = _inode(lock)
            if now is None:
                return GONE, None  # it was being released
            if now != inode:
                return lock_state(lock, proc, mounts, euid, recheck_s, sleep)  # a new build took it
    return STALE, inode


def _describe(pids, proc="/proc"):
    out = []
    for pid in pids:
        try:
            with open(os.path.join(proc, str(pid), "cmdline"), "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            cmd = "?"
        out.append(f"pid {pid} ({cmd[:80]})")
    return ", ".join(out)


def remove_if_stale(lock, inode):
    """Remove ``lock`` if it is still the file ``inode`` names; True if removed."""
    if _inode(lock) != inode:
        return False
    try:
        os.remove(lock)
        return True
    except FileNotFoundError:
        return False


def clear_stale_locks(dirs, say=_say, report_held=True, proc="/proc", mounts="/proc/self/mounts", euid=None,
                      recheck_s=RECHECK_S, wait_poll_s=WAIT_POLL_S, sleep=None):
    """Check every ``<dir>/<op>/lock`` under ``dirs``: remove the stale ones, wait for orphaned
    builds to end (then remove their lock), leave held ones. Returns ([removed], [(lock, reason)
    the test could not decide]). ``say`` gets one line per lock removed, waited for, undecided, or
    (with ``report_held``) held."""
    import time
    sleep = time.sleep if sleep is None else sleep
    removed, unknown = [], []
    for lock in find_locks(dirs):
        waited = False
        while True:
            verdict, detail = lock_state(lock, proc, mounts, euid, recheck_s, sleep)
            if verdict == ORPHAN_BUILD:
                if not waited:
                    say(f"{lock}: left by a killed build whose ninja still runs ({_describe(detail, proc)}); "
                        f"waiting for it to end, then removing the lock")
                    waited = True
                sleep(wait_poll_s)
                continue
            break
        if verdict == STALE:
            if remove_if_stale(lock, detail):
                removed.append(lock)
                say(f"removed {lock}: a torch extension build lock that no process holds (a build was killed; "
                    f"the op is rebuilt or reloaded at its next use)")
        elif verdict == HELD and report_held:
            say(f"{lock}: a build of this op is running ({_describe(detail, proc)}); a load of the op waits for it")
        elif verdict == UNKNOWN:
            unknown.append((lock, detail))
            say(f"{lock}: a torch extension build lock that is not checked here ({detail}); if no build is "
                f"running, remove it (rm {lock}), or a load of the op waits forever")
    return removed, unknown


# --------------------------------------------------------------------------- the hook


def startup():
    """Called by zero3muon_venv.pth at interpreter start. Never raises."""
    try:
        if os.environ.get(ENV_SWITCH, "1") == "0" or sys.prefix == getattr(sys, "base_prefix", sys.prefix):
            return
        path = os.environ.get("PATH", "")
        new_path = path_with_venv_ninja(sys.prefix, path)
        if new_path != path:
            os.environ["PATH"] = new_path
        dirs = extension_dirs()
        if find_locks(dirs):
            clear_stale_locks(dirs, report_held=False)  # a load waiting for a running build is normal
    except Exception as e:  # a broken check must not break the interpreter
        _say(f"venv startup hook failed ({type(e).__name__}: {e}); set {ENV_SWITCH}=0 to turn it off")


PTH_LINE = "import zero3muon_venv; zero3muon_venv.startup()\n"
