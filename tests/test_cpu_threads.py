from models.cpu_threads import ALL_THREADS, ONE_THREAD, ThreadChooser


def run(chooser: ThreadChooser, steps: int, seconds: dict[str, float], batch: int = 1) -> list[str]:
    """Feeds ``steps`` decode steps whose time depends only on the mode; returns the modes used."""
    modes = []
    for _ in range(steps):
        mode = chooser.choose(batch)
        chooser.record(mode, batch, seconds[mode])
        modes.append(mode)
    return modes


def test_moves_to_one_thread_when_that_is_faster_and_back_when_the_host_frees_up():
    chooser = ThreadChooser(2)
    contended = {ALL_THREADS: 0.070, ONE_THREAD: 0.022}
    modes = run(chooser, 10, contended)
    assert modes[:3] == [ALL_THREADS] * 3 and modes[3:6] == [ONE_THREAD] * 3
    assert chooser.mode == ONE_THREAD and modes[6:] == [ONE_THREAD] * 4
    idle = {ALL_THREADS: 0.016, ONE_THREAD: 0.021}
    run(chooser, ThreadChooser.MIN_INTERVAL + ThreadChooser.PROBE_STEPS, idle)
    assert chooser.mode == ALL_THREADS


def test_a_much_slower_probe_step_ends_the_probe():
    chooser = ThreadChooser(2)
    run(chooser, 6, {ALL_THREADS: 0.070, ONE_THREAD: 0.022})          # now on one thread
    assert chooser.mode == ONE_THREAD
    modes = run(chooser, ThreadChooser.MIN_INTERVAL + 2, {ALL_THREADS: 0.070, ONE_THREAD: 0.022})
    assert modes.count(ALL_THREADS) == 1 and modes[-2:] == [ALL_THREADS, ONE_THREAD], modes
    assert chooser.mode == ONE_THREAD and chooser.interval == 2 * ThreadChooser.MIN_INTERVAL


def test_keeps_the_faster_mode_and_probes_ever_more_rarely():
    chooser = ThreadChooser(2)
    idle = {ALL_THREADS: 0.016, ONE_THREAD: 0.021}
    modes = run(chooser, 3000, idle)
    assert chooser.mode == ALL_THREADS
    runs = "".join("a" if m == ALL_THREADS else "o" for m in modes).split("ooo")
    gaps = [len(r) for r in runs[:-1]]       # all-threads steps between probes: 3, 16, 32, ..., 1024
    assert gaps == [3, 16, 32, 64, 128, 256, 512, 1024][:len(gaps)] and len(gaps) >= 7, gaps
    assert chooser.interval == ThreadChooser.MAX_INTERVAL


def test_compares_only_steps_of_the_same_batch():
    chooser = ThreadChooser(2)
    same = {ALL_THREADS: 0.016, ONE_THREAD: 0.016}
    run(chooser, 3, same, batch=4)                     # a probe is due
    assert chooser.choose(1) == ALL_THREADS, "no probe before three steps of its own batch"
    chooser.record(ALL_THREADS, 1, 0.016)
    run(chooser, 2, same, batch=1)
    assert chooser.choose(1) == ONE_THREAD
    chooser.record(ONE_THREAD, 1, 0.001)               # far faster, but the probe is cut short:
    assert chooser.choose(2) == ALL_THREADS            # the batch changed, so it is dropped, not judged
    chooser.record(ALL_THREADS, 2, 0.016)
    assert chooser.mode == ALL_THREADS
