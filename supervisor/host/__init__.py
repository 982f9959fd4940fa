"""The host's I/O that the core decides on (run by sessiond): the /proc
files of sessions' processes kept open (proctable.py), the measuring
thread's reads (measure.py: PSS, memfds, tmpfs, workspace walks), which
disk cap holds and the workspaces' walk (diskquota.py), btrfs subvolumes
and qgroups (btrfs.py), a workspace made, capped, mounted and removed
(workspaces.py), passwd/group lookups (users.py), and the daemon's own
file descriptors: its limit and how many are open (fds.py), and its
freed heap given back to the kernel (heap.py).

The core decides (whose workspace, which reads, which verdict); this
folder does, and holds no session state of its own.  May import: ipc/,
supervisor.config, supervisor.errors, supervisor.logtag and
supervisor.spawn (workspace images, pidfds, the ceilings' refusal).  Never
the core: the core calls it.
"""
