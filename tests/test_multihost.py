"""Several processes on this machine, as the hosts of a multi-host slice (docs/multihost.md):
`mkresearch launch --processes 2 -- decode ... --ranks 8 --backend reference` (2 processes x 4
CPU devices, JAX's gloo collectives between them) against the same command in one process with
8 devices (its `--ranks` child): the same tokens, and every step's logits bit for bit (their
sha256, `cli.ranks_reference`), for kimi-k3-mini (a random model) and deepseek-v3-mini (an FP8
checkpoint in 2 files, each process reading only its ranks' shards); a process killed mid-run
(SIGKILL, SIGTERM or SIGINT, to either process) ends the run with one line naming it and the
signal, in bounded time, and no process is left.

Timings here (2 shared cores, busy): the kimi-k3-mini pair 47-60 s, the checkpoint pair 34-40 s,
a signalled run ~7-15 s (the launcher ends ~0.5-1 s after the signal), the interpret-mode wait
~20 s.
`make test` runs the checkpoint pair (deepseek-v3-mini, bit for bit across processes); the
random-model pairs (kimi-k3-mini and the other families, the exact collectives) run in the
exhaustive tier. The megakernel cannot run across
processes off a TPU: interpret mode's remote copies wait forever for a peer in another process
(shown below with the waiting stack), so it is refused in one line; its multi-host path is
compiled for a multi-host TPU topology by tests/test_cli_compile_check.py (v5e:2x4: 2 hosts).
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from mkresearch.kernels.compose import megakernel_sharded as sharded
from test_tokenizer import tiny_tokenizer_json
from tiers import EXHAUSTIVE

from mkresearch.cli import launch
from mkresearch.cli import main as cli
from mkresearch.cli import ranks as cli_ranks
from mkresearch.hardware import distributed

HANG_GUARD_S = 1500  # far above any run here: a hang fails the test, never a slow machine
KILL_BOUND_S = 120  # a hang guard for a run to end once a process died or was signalled
# (~0.5-1 s measured)
PROMPT = "a prompt"  # 6 tokens of the tiny tokenizer: 7 steps with --steps 2


def _env() -> dict:
    return {k: v for k, v in os.environ.items()
            if k != cli_ranks.CHILD_ENV and k not in distributed.ENV}


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "mkresearch", *argv], capture_output=True,
                          text=True, timeout=HANG_GUARD_S, env=_env(), check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def _result(done: subprocess.CompletedProcess) -> dict:
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, done.stdout  # process 0's one JSON object, nothing else
    return json.loads(lines[0])


def one_and_two_processes(command: list[str]) -> tuple[dict, dict]:
    """`command --json` with --ranks 8 in one process (8 devices: its --ranks child) and
    launched as 2 processes of 4 devices -> (one, two), timed."""
    started = time.perf_counter()
    one = _result(_run([*command, "--ranks", "8", "--json"]))
    middle = time.perf_counter()
    two = _result(_run(["launch", "--processes", "2", "--", *command, "--ranks", "8", "--json"]))
    print(f"1 x 8 devices: {middle - started:.0f} s; 2 x 4: {time.perf_counter() - middle:.0f} s")
    assert (one["processes"], one["devices"]) == (1, 8)
    assert (two["processes"], two["devices"], two["local_devices"]) == (2, 8, 4)
    return one, two


def assert_bit_equal(one: dict, two: dict) -> None:
    assert two["generated"] == one["generated"]
    assert two["logits_sha256"] == one["logits_sha256"]  # every step's logits, every bit


@pytest.mark.slow
@pytest.mark.parametrize("model, collectives", [  # every case exhaustive (~45 s each here): make
    # test runs two processes against one in test_a_checkpoint_read_per_process (bits equal)
    pytest.param("kimi-k3-mini", "partial-sum", marks=pytest.mark.exhaustive),
    pytest.param("deepseek-v3-mini", "partial-sum", marks=pytest.mark.exhaustive),
    pytest.param("glm-4.5-mini", "exact", marks=pytest.mark.exhaustive),
    pytest.param("qwen3-235b-a22b-mini", "partial-sum", marks=pytest.mark.exhaustive),
])
def test_two_processes_equal_one_process_bit_for_bit(model, collectives):
    """The sharded reference over 2 processes x 4 devices: the tokens and logits of 1 x 8, and
    (process 0 holding every weight of a random model) the single-device sharded reference's
    logits at every step."""
    steps = ["--steps", "4"] if EXHAUSTIVE else ["--steps", "2"]
    one, two = one_and_two_processes(["decode", model, "--backend", "reference",
                                      "--collectives", collectives, "--prompt-len", "2",
                                      "--batch", "2", *steps])
    assert_bit_equal(one, two)
    for result in (one, two):
        single = result["single_device"]
        assert single["passed"] and single["logits_bit_equal_steps"] == single["steps"]


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    """deepseek-v3-mini as DeepSeek-V3 ships it (FP8 projections, 128 x 128 block scales), in
    2 safetensors files, with a tiny tokenizer."""
    from mkresearch.checkpoint.loader import write_checkpoint
    from mkresearch.model import weights
    from mkresearch.model.config import get_config

    directory = tmp_path_factory.mktemp("deepseek-fp8")
    cfg = get_config("deepseek-v3-mini")
    write_checkpoint(directory, weights.init_params(cfg, seed=3), cfg, fp8=True, shards=2)
    tiny_tokenizer_json(directory)
    return directory


@pytest.mark.slow
def test_a_checkpoint_read_per_process(fp8_checkpoint):
    """Each of 2 processes reads only its ranks' shards (byte ranges; its share of the files,
    the two together about the whole); the tokens and logits equal one process's, which reads
    every rank's."""
    one, two = one_and_two_processes(["decode", "--checkpoint", str(fp8_checkpoint), "--prompt",
                                      PROMPT, "--backend", "reference", "--steps", "2"])
    assert_bit_equal(one, two)
    assert one["text"] == two["text"]
    total = one["bytes_read"][0]["total_bytes"]
    [whole] = one["bytes_read"]
    first, second = two["bytes_read"]
    print("bytes read: one process " + f"{whole['bytes_read']:,d}; two: "
          f"{first['bytes_read']:,d} + {second['bytes_read']:,d} of {total:,d}")
    assert (first["process"], first["ranks"], second["process"], second["ranks"]) == (
        0, "0-3", 1, "4-7")
    for row in (first, second):
        assert row["bytes_read"] < 0.75 * total  # its ranks' shards, not the files
    together = first["bytes_read"] + second["bytes_read"]
    # every byte some rank holds is read by the process holding it; weights every rank holds
    # whole (norms, a head on several ranks) by each process: a little over the whole
    assert whole["bytes_read"] <= together < 1.1 * whole["bytes_read"]
    # one process reads about the files; a little over them: an FP8 scale block that straddles
    # two ranks' slices is read for each (4 bytes a time)
    assert 0.9 * total < whole["bytes_read"] < 1.01 * total


@pytest.mark.slow
@pytest.mark.parametrize("sig, target", [  # ~5-7 s each here; the other two pairs: exhaustive
    pytest.param(sig, target, id=f"{sig.name}-to-process-{target}",
                 marks=[pytest.mark.exhaustive] if exhaustive else [])
    for sig, target, exhaustive in ((signal.SIGKILL, 1, False), (signal.SIGTERM, 0, False),
                                    (signal.SIGINT, 1, False), (signal.SIGTERM, 1, True),
                                    (signal.SIGINT, 0, True))])
def test_a_signalled_process_ends_the_run_with_one_line_naming_it(sig, target):
    """A signal to process `target` once it has joined and is running: the run ends, the
    launcher's last line names that process and the signal, its exit status is 128 + the
    signal, the other process is stopped and none is left. SIGTERM and SIGINT too: a joined
    process restores their default actions (`distributed.end_on_signals`; issue 79: JAX's
    preemption service swallowed SIGTERM, the run finishing with exit 0, and SIGINT took 31-34 s,
    blamed process 0 or hung). The time from the signal to the launcher's end is printed
    (~0.5 s measured), bounded only by the hang guard."""
    launcher = subprocess.Popen(
        [sys.executable, "-m", "mkresearch", "launch", "--processes", "2", "--", "decode",
         "kimi-k3-mini", "--ranks", "2", "--backend", "reference", "--steps", "60",
         "--prompt-len", "4"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=_env())
    try:
        pids, lines = [], []
        for line in launcher.stderr:
            lines.append(line)
            if match := re.search(r"\(pids (\d+), (\d+)\)", line):
                pids = [int(match.group(1)), int(match.group(2))]
            if "process 1 of 2 joined" in line:
                break
        assert pids, "".join(lines)
        time.sleep(2)  # mid-run: joined, weights placed or the step compiling
        os.kill(pids[target], sig)
        sent = time.perf_counter()
        _, rest = launcher.communicate(timeout=KILL_BOUND_S)  # (stdout, stderr)
        print(f"{sig.name} to process {target}: the launcher ended "
              f"{time.perf_counter() - sent:.1f} s after it")
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 128 + sig, rest[-4000:]
    last = rest.strip().splitlines()[-1]
    assert last == (f"{launch.PREFIX}: process {target} of 2 (pid {pids[target]}) was killed by "
                    f"{sig.name}; stopped the other 1")
    assert sum(f"(pid {pids[target]})" in line for line in rest.splitlines()) == 1
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # reaped: neither left running nor a zombie


@pytest.mark.slow
@pytest.mark.parametrize("command", ["decode", "bench"])
def test_the_megakernel_across_processes_is_refused_in_one_line(command):
    """Off a TPU each process refuses before any work, the first failure's line ends the run."""
    done = subprocess.run(
        [sys.executable, "-m", "mkresearch", "launch", "--processes", "2", "--", command,
         "kimi-k3-mini", "--ranks", "2"], capture_output=True, text=True,
        timeout=HANG_GUARD_S, env=_env(), check=False)
    assert done.returncode == 2 and done.stdout == ""
    last = done.stderr.strip().splitlines()[-1]
    # whichever refused first (both do)
    assert re.match(rf"{launch.PREFIX}: process [01] of 2 \(pid \d+\) exited with status 2 "
                    rf"\(mkresearch: {command} --ranks 2 over 2 processes needs a TPU "
                    "for the megakernel: ", last), last
    assert "--backend reference)" in last and "; stopped the other" in last


REMOTE_COPY = os.path.join(os.path.dirname(__file__), "multihost_remote_copy.py")


@pytest.mark.slow
def test_interpret_mode_waits_forever_for_a_peer_in_another_process():
    """Why the megakernel is refused across processes off a TPU, shown: a remote DMA kernel
    (barrier semaphore, then a remote copy) over 2 processes x 1 device never ends; each process
    waits in interpret mode's `semaphore_wait` for a signal its peer sent into the other
    process's memory (tests/multihost_remote_copy.py). No error is raised: both are killed."""
    port = launch.free_port()
    processes = [subprocess.Popen([sys.executable, REMOTE_COPY, str(i), str(port)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env=_env(), start_new_session=True) for i in range(2)]
    stacks = []
    try:
        deadline = time.monotonic() + HANG_GUARD_S
        for process in processes:  # each dumps its stack every few seconds while it waits
            stack = []
            for line in process.stderr:
                assert time.monotonic() < deadline, "".join(stack)
                stack = [] if line.startswith(("Thread 0x", "Current thread 0x")) else stack
                stack.append(line)
                if "multihost_remote_copy.py" in line and "in semaphore_wait" in "".join(stack):
                    break  # the stack from the kernel's call down to the wait
            stacks.append("".join(stack))
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    outputs = [process.stdout.read() for process in processes]
    for stack, out in zip(stacks, outputs):
        assert "ran" not in out
        frames = [line for line in stack.splitlines()[1:] if "threading.py" not in line]
        top = frames[:2]  # the waiting thread's innermost frames above Python's threading
        assert "interpret/shared_memory.py" in top[0] and " in wait" in top[0], stack
        assert "interpret/interpret_pallas_call.py" in top[1], stack
    print("process 0's stack:\n" + stacks[0])


# ---- without starting processes ---------------------------------------------------------------
def test_a_run_is_named_by_flags_else_the_environment():
    env = {distributed.COORDINATOR_ENV: "10.0.0.2:8476", distributed.PROCESS_ID_ENV: "1",
           distributed.NUM_PROCESSES_ENV: "4", distributed.LOCAL_DEVICES_ENV: "2"}
    assert distributed.runtime_from(environ={}) is None
    assert distributed.runtime_from(environ=env) == distributed.Runtime("10.0.0.2:8476", 1, 4, 2)
    assert distributed.runtime_from("h:1", 0, 2, environ=env) == distributed.Runtime("h:1", 0, 2,
                                                                                      2)
    assert distributed.runtime_from("auto", environ={}) == distributed.Runtime("auto")


@pytest.mark.parametrize("given, message", [
    ({"coordinator": "h:1", "process_id": 0}, "needs the process id and count"),
    ({"coordinator": "h:1", "process_id": 2, "num_processes": 2}, "process id 2 is invalid"),
    ({"coordinator": "h", "process_id": 0, "num_processes": 2}, "HOST:PORT"),
    ({"process_id": 0, "num_processes": 2}, "needs a coordinator"),
    ({"coordinator": "h:1", "process_id": "x", "num_processes": 2}, "an int >= 0"),
    ({"coordinator": "auto", "local_devices": 0}, "an int >= 1"),
])
def test_a_bad_run_is_named_in_one_line(given, message):
    with pytest.raises(ValueError, match=message):
        distributed.runtime_from(**given, environ={})


@pytest.mark.parametrize("argv, message", [
    (["launch", "--processes", "2"], "launch needs a command after --"),
    (["launch", "--processes", "0", "--", "info", "kimi-k3"], "--processes must be an int >= 1"),
    (["launch", "--processes", "3", "--", "decode", "--ranks", "8"],
     "--ranks 8 does not split over --processes 3"),
    (["launch", "--processes", "2", "--", "launch"], "launch cannot launch itself"),
    (["decode", "--coordinator", "h:1"], "needs the process id and count"),
])
def test_bad_launches_are_one_line_exit_2(capsys, argv, message):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_the_compiled_slices_meshes_span_their_hosts():
    """The mesh a run on a multi-host TPU slice builds (and `compile --ranks` compiles for): one
    process per host, a host's devices consecutive ranks."""
    for topology, hosts in (("v5e:2x4", 2), ("tpu7x:2x2x4", 4)):
        mesh = sharded.make_mesh_on(topology, 8 * hosts if topology == "tpu7x:2x2x4" else 8)
        owners = [d.process_index for d in mesh.devices.flat]
        assert owners == sorted(owners) and len(set(owners)) == hosts
