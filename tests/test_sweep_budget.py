"""The sweep's reads off the loop: the verdict with partial reads (pure),
the budget a batch keeps and the readers (component, on this process and
a temp dir), and the workspace's walk in slices."""

from __future__ import annotations

import os

import pytest

from supervisor.host.diskquota import DiskWalk, detect
from supervisor.core.limits import (
    MIB,
    PssEstimate,
    PssRead,
    disk_over,
    patience,
    pss_estimate,
    read_order,
    settled_figure,
    unmapped_total,
)
from supervisor.host.measure import FDS_PER_UNIT, Kind, Read, host_identity, run_batch

CAP = 100 * MIB


# ---------------------------------------------------------------- pure: the figure


@pytest.mark.pure
def test_unread_processes_count_their_rss_and_read_ones_their_pss() -> None:
    rss = {1: 30 * MIB, 2: 30 * MIB, 3: 30 * MIB}
    est = pss_estimate(rss, {1: PssRead(10 * MIB, 30 * MIB, 1)})
    assert est == PssEstimate(total=70 * MIB, known=10 * MIB, unread=2)


@pytest.mark.pure
def test_growth_after_a_read_counts_in_full_and_a_shrink_caps_the_known_part() -> None:
    # Read at 10 MiB of PSS with 30 of RSS; it has since grown to 530 of RSS.
    grown = pss_estimate({1: 530 * MIB}, {1: PssRead(10 * MIB, 30 * MIB, 1)})
    assert grown.total == 510 * MIB and grown.known == 10 * MIB
    # Read at 80 MiB, now down to 20 of RSS: at most 20 is known to be held.
    shrunk = pss_estimate({1: 20 * MIB}, {1: PssRead(80 * MIB, 90 * MIB, 1)})
    assert shrunk.known == 20 * MIB and shrunk.total == 80 * MIB


@pytest.mark.pure
@pytest.mark.parametrize("est, extra, waited, figure", [
    # Every process read: the estimate is the figure, whatever it says.
    (PssEstimate(150 * MIB, 150 * MIB, 0), 0, 0, 150 * MIB),
    (PssEstimate(50 * MIB, 50 * MIB, 0), 0, 0, 50 * MIB),
    # Under the cap even counting RSS for the unread: under it by PSS too.
    (PssEstimate(90 * MIB, 5 * MIB, 40), 0, 0, 90 * MIB),
    # Over by the read part alone: over, kill now, the rest unread.
    (PssEstimate(900 * MIB, 120 * MIB, 40), 0, 0, 120 * MIB),
    # ... and unmapped memory is known, not estimated: it tips the read part over.
    (PssEstimate(900 * MIB, 60 * MIB, 40), 50 * MIB, 0, 110 * MIB),
    # Between the two: wait for the reads...
    (PssEstimate(900 * MIB, 60 * MIB, 40), 0, 0, None),
    (PssEstimate(900 * MIB, 60 * MIB, 40), 0, 14, None),
    # ... but not for ever: past the patience, the unread count their RSS.
    (PssEstimate(900 * MIB, 60 * MIB, 40), 0, 15, 900 * MIB),
])
def test_the_verdict_with_partial_reads(est: PssEstimate, extra: int, waited: int, figure: int | None) -> None:
    assert settled_figure(est, extra, CAP, waited, 15) == figure


@pytest.mark.pure
def test_a_session_under_its_cap_by_pss_is_read_in_full_before_its_patience_ends() -> None:
    """Simulate the sweep: 511 forks of a 30 MiB process (RSS 15 GiB summed,
    PSS ~40 MiB), 64 reads a batch.  It is never judged on a guess, and
    settles under the cap well before the patience would count RSS."""
    rss = {pid: 30 * MIB for pid in range(1, 512)}
    true_pss = {pid: (30 * MIB if pid == 1 else 20 * 1024) for pid in rss}
    reads: dict[int, PssRead] = {}
    waited = 0
    limit = patience(len(rss), 64)
    for tick in range(1, limit + 1):
        figure = settled_figure(pss_estimate(rss, reads), 0, 1024 * MIB, waited, limit)
        if figure is not None:
            break
        waited += 1
        for pid in read_order(rss, reads, 64):
            reads[pid] = PssRead(true_pss[pid], rss[pid], tick)
    else:
        pytest.fail("never settled within its patience")
    assert figure < 1024 * MIB and waited < limit
    assert waited == -(-511 // 64)  # one batch per 64 processes


@pytest.mark.pure
def test_a_session_that_forks_faster_than_the_reads_is_judged_once_its_patience_ends() -> None:
    """New processes every batch, more than the budget reads: the unread
    never reach zero, and after the patience their RSS counts: no escape."""
    rss: dict[int, int] = {}
    reads: dict[int, PssRead] = {}
    waited, next_pid, figure = 0, 1, None
    limit = patience(128, 64)
    for tick in range(1, 100):
        for _ in range(128):  # the bomb: 128 new 8 MiB processes a batch
            rss[next_pid] = 8 * MIB
            next_pid += 1
        figure = settled_figure(pss_estimate(rss, reads), 0, CAP, waited, limit)
        if figure is not None:
            break
        waited += 1
        for pid in read_order(rss, reads, 64):
            reads[pid] = PssRead(4 * 1024, rss[pid], tick)  # mostly shared: small PSS
    assert figure is not None and figure > CAP and tick <= limit + 1


@pytest.mark.pure
def test_reads_go_to_the_unread_largest_first_then_to_the_oldest() -> None:
    rss = {1: 5, 2: 50, 3: 20, 4: 10, 5: 10}
    reads = {4: PssRead(1, 10, tick=7), 5: PssRead(1, 10, tick=3)}
    assert read_order(rss, reads, 2) == [2, 3]
    assert read_order(rss, reads, 4) == [2, 3, 1, 5]
    assert read_order(rss, reads, 10) == [2, 3, 1, 5, 4]
    # Reads made since sweep 5 are fresh enough: not read again yet.
    assert read_order(rss, reads, 10, stale_before=5) == [2, 3, 1, 5]


@pytest.mark.pure
def test_unmapped_memory_counts_each_inode_once() -> None:
    a, b = (1, 100), (1, 200)
    held = [{a: 300 * MIB}, {a: 300 * MIB, b: 10 * MIB}, {}]  # a shared by two processes
    assert unmapped_total(held, 40 * MIB) == 350 * MIB


@pytest.mark.pure
def test_disk_over() -> None:
    assert disk_over(101 * MIB, 100) and not disk_over(100 * MIB, 100)
    assert not disk_over(1 << 50, None)  # no quota


@pytest.mark.pure
def test_patience_is_two_rounds_of_reads_and_some() -> None:
    assert patience(1, 64) == 7
    assert patience(511, 64) == 2 * 8 + 5


# ---------------------------------------------------------------- component: the thread's side


@pytest.mark.component
def test_a_batch_makes_no_more_reads_than_its_budget_and_leaves_the_rest_for_the_next() -> None:
    me = os.getpid()
    reads = [Read(Kind.PSS, "s", me) for _ in range(10)]
    run_batch(reads, host_identity(), budget=3)
    assert [r.done for r in reads] == [True] * 3 + [False] * 7
    assert all(r.pss is not None and r.pss > 0 for r in reads[:3])
    # The next batch reads what this one did not.
    run_batch([r for r in reads if not r.done], host_identity(), budget=64)
    assert all(r.done for r in reads)


@pytest.mark.component
def test_an_fd_listing_costs_by_its_descriptors() -> None:
    fds = [os.open("/dev/null", os.O_RDONLY) for _ in range(3 * FDS_PER_UNIT)]
    try:
        reads = [Read(Kind.FDS, "s", os.getpid()), Read(Kind.PSS, "s", os.getpid())]
        run_batch(reads, host_identity(), budget=3)
        assert reads[0].done and not reads[1].done  # the listing took the budget
    finally:
        for fd in fds:
            os.close(fd)


@pytest.mark.component
def test_memfds_written_not_mapped_are_found_by_inode_and_allocated_size() -> None:
    fd = os.memfd_create("hog")
    sparse = os.memfd_create("sparse")
    dup = os.dup(fd)
    try:
        chunk = b"x" * MIB
        for _ in range(8):
            os.write(fd, chunk)
        os.ftruncate(sparse, 1 << 30)  # 1 GiB long, nothing written: nothing held
        read = Read(Kind.FDS, "s", os.getpid())
        run_batch([read], host_identity())
        sizes = sorted(read.held.values())
        assert len(read.held) == 2  # two inodes, the dup counted once
        assert sizes[0] == 0 and 8 * MIB <= sizes[1] < 9 * MIB
        assert read.mnt_ns == host_identity().mnt_ns
    finally:
        for f in (fd, sparse, dup):
            os.close(f)


@pytest.mark.component
def test_the_hosts_tmp_is_never_counted_as_a_sessions() -> None:
    read = Read(Kind.TMPFS, "s", os.getpid())
    run_batch([read], host_identity())
    assert read.done and read.tmpfs == 0


@pytest.mark.component
def test_the_walk_counts_allocated_blocks_in_slices_links_once_and_no_symlink(tmp_path) -> None:
    ws = tmp_path / "ws"
    (ws / "a" / "b").mkdir(parents=True)
    with open(ws / "a" / "b" / "big", "wb") as f:
        os.posix_fallocate(f.fileno(), 0, 64 * MIB)  # allocated, never written
    os.link(ws / "a" / "b" / "big", ws / "hardlink")
    with open(ws / "sparse", "wb") as f:
        f.truncate(1 << 30)
    outside = tmp_path / "outside"
    outside.mkdir()
    with open(outside / "other", "wb") as f:
        os.posix_fallocate(f.fileno(), 0, 32 * MIB)
    os.symlink(outside, ws / "link")
    for i in range(50):
        (ws / f"f{i}").write_bytes(b"")
    walk = DiskWalk(str(ws))
    steps = 0
    while not walk.done:
        assert walk.step(8) <= 8
        steps += 1
    assert steps > 5  # in slices
    assert 64 * MIB <= walk.total < 65 * MIB


@pytest.mark.component
def test_a_missing_workspace_holds_nothing(tmp_path) -> None:
    walk = DiskWalk(str(tmp_path / "none"))
    walk.step(10)
    assert walk.done and walk.total == 0


@pytest.mark.component
def test_detect_names_the_measured_path_where_the_operator_chose_it(tmp_path) -> None:
    path = detect(tmp_path / "not" / "yet", "measured")
    assert path.kind == "measured" and "walked" in path.describe() and "disk_quota" in path.describe()


@pytest.mark.component
def test_walks_share_a_batch_so_a_huge_workspace_does_not_hold_the_others_back(tmp_path) -> None:
    huge, small = tmp_path / "huge", tmp_path / "small"
    huge.mkdir()
    small.mkdir()
    for i in range(3000):
        (huge / f"f{i}").write_bytes(b"")
    with open(small / "big", "wb") as f:
        os.posix_fallocate(f.fileno(), 0, 8 * MIB)
    walks = [DiskWalk(str(huge)), DiskWalk(str(small))]
    run_batch([Read(Kind.DISK, "a", walk=walks[0]), Read(Kind.DISK, "b", walk=walks[1])], host_identity(),
              walk_entries=1024)
    assert not walks[0].done  # 3,000 entries: a batch's share is 512
    assert walks[1].done and walks[1].total >= 8 * MIB


@pytest.mark.component
def test_a_directory_swapped_for_a_symlink_mid_walk_is_not_followed(tmp_path) -> None:
    ws, outside = tmp_path / "ws", tmp_path / "outside"
    (ws / "d").mkdir(parents=True)
    outside.mkdir()
    with open(outside / "big", "wb") as f:
        os.posix_fallocate(f.fileno(), 0, 32 * MIB)
    walk = DiskWalk(str(ws))
    walk.step(2)  # the root read: "d" found, to be read next
    assert not walk.done
    (ws / "d").rmdir()
    os.symlink(outside, ws / "d")
    while not walk.done:
        walk.step(8)
    assert walk.total < MIB


@pytest.mark.component
def test_posix_shm_held_open_counts_in_the_daemons_mount_namespace() -> None:
    """Outside a namespace of the session's own, /dev/shm is the host's,
    which no tmpfs figure of the session covers: a file there held open
    counts (by inode, as a memfd)."""
    path = f"/dev/shm/sessiond-test-{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, b"z" * (4 * MIB))
        read = Read(Kind.FDS, "s", os.getpid())
        run_batch([read], host_identity())
        assert sum(read.held.values()) >= 4 * MIB
    finally:
        os.close(fd)
        os.unlink(path)
