"""Continuous batching over paged KV (`mkresearch.serve`): a row joining a running batch at step k
decodes the same tokens as alone, freed pages are reused without leaking their values, a full
pool makes a row wait, and the workload bench's data and command.

One trace on a two-layer mini (KDA + dense, MLA + MoE: every kind of state, two compiles shared
by the module) serves every claim of the reference step; one short trace runs the megakernel.
"""

import json
import re

import jax
import pytest
from cuts import first_layers

from mkresearch.cli import main as cli
from mkresearch.cli import workload as cli_workload
from mkresearch.model import config, paged_kv, weights
from mkresearch.prediction.full_size import full_size_step
from mkresearch.serve import loop, pages, trace, workload

# KDA + dense then MLA + MoE: the mini's kinds in two layers (a cheap compile)
CFG = first_layers(config.get_config("kimi-k3-mini"), 2)
PAGES = paged_kv.PagedKVConfig(page_size=16, n_pages=3, max_pages_per_row=2)
BATCH = 2
Request = trace.Request
# A holds 2 pages and runs steps 0-12; B (greedy) joins at step 2 in slot 1 on page 2 and leaves
# after step 4; C (sampled) arrives at 3, joins at 5 on B's freed page; D needs 2 pages, arrives
# at 6 and waits with slot 1 free from step 9 (one free page) until A leaves: it takes A's pages
# (and A's slot, the lowest empty one).
TRACE = [Request(0, prompt_len=5, output_len=14, arrival=0),
         Request(1, prompt_len=5, output_len=4, arrival=2),
         Request(2, prompt_len=5, output_len=5, arrival=3, temperature=1.0, seed=7),
         Request(3, prompt_len=20, output_len=4, arrival=6)]


@pytest.fixture(scope="module")
def params():
    return weights.init_params(CFG, 0)


@pytest.fixture(scope="module")
def served(params):
    """The trace served with every freed page filled with POISON before its next owner."""
    return loop.serve(params, TRACE, CFG, PAGES, batch=BATCH, poison_freed=True)


def alone(params, request, step="reference"):
    """The request served by itself (arriving at 0: slot 0, the lowest pages, a fresh pool)."""
    single = Request(request.index, request.prompt_len, request.output_len, 0,
                     request.temperature, request.seed)
    return loop.serve(params, [single], CFG, PAGES, batch=BATCH, step=step).tokens[request.index]


@pytest.mark.slow
def test_a_row_joining_at_step_k_decodes_as_alone(params, served):
    assert served.joined_at == {0: 0, 1: 2, 2: 5, 3: 13}
    assert served.slot_of == {0: 0, 1: 1, 2: 1, 3: 0}
    for request in TRACE:
        tokens = served.tokens[request.index]
        assert len(tokens) == request.output_len
        assert tokens == alone(params, request), f"request {request.index}"
    # rows of mixed lengths shared steps: step 3 held A at 9 tokens and B at 7
    assert served.steps[3].lengths == [9, 7]


@pytest.mark.slow
def test_freed_pages_are_reused_without_leaking(served):
    # C takes the page B freed and D the pages A freed, each filled with POISON when freed: the
    # rows equal their alone runs above (fresh zero pages), so no step read a value it had not
    # written, in the pages' slots past a row's length as before it
    assert served.pages_of == {0: [0, 1], 1: [2], 2: [2], 3: [0, 1]}
    assert served.left_at[1] < served.joined_at[2] and served.left_at[0] < served.joined_at[3]
    owners = [record.page_owner for record in served.steps]
    assert owners[3] == [0, 0, 1] and owners[5] == [0, 0, 2] and owners[13] == [3, 3, -1]


@pytest.mark.slow
def test_a_full_pool_makes_a_row_wait(served):
    # D arrived at 6; from step 9 slot 1 was empty but only one page was free: D waited
    waited = [record for record in served.steps if 6 <= record.step < served.joined_at[3]]
    assert any(record.slots == [0, -1] for record in waited)
    assert all(sum(owner == -1 for owner in record.page_owner) < 2 for record in waited)


def test_the_allocator_hands_out_the_lowest_free_pages_and_refuses_what_never_fits():
    allocator = pages.PageAllocator(3, 16)
    assert allocator.allocate(0, 20) == [0, 1] and allocator.allocate(1, 20) is None
    allocator.free(0)
    assert allocator.allocate(1, 20) == [0, 1]
    with pytest.raises(ValueError, match="the pool holds 3"):
        allocator.allocate(2, 64)


@pytest.mark.slow
def test_a_row_leaves_on_eos(params, served):
    first = TRACE[0]
    eos = served.tokens[0][2]
    result = loop.serve(params, [first], CFG, PAGES, batch=BATCH, eos=eos)
    assert result.tokens[0] == served.tokens[0][:served.tokens[0].index(eos) + 1]
    assert result.left_at[0] == served.tokens[0].index(eos) - 1  # the step that drew it


@pytest.mark.slow
def test_megakernel_row_joining_at_step_k_decodes_as_alone(race_checked, params):
    # A leaves after step 1; B (greedy) joins at 1 in slot 1; C (sampled) joins at 2 in slot 0 on
    # A's freed, poisoned page, beside B: the kernel reads each row's pages below its length only
    short = [Request(0, prompt_len=5, output_len=3, arrival=0),
             Request(1, prompt_len=5, output_len=4, arrival=1),
             Request(2, prompt_len=5, output_len=3, arrival=2, temperature=1.0, seed=5)]
    result = loop.serve(params, short, CFG, PAGES, batch=BATCH, step="megakernel",
                        poison_freed=True)
    assert result.joined_at == {0: 0, 1: 1, 2: 2} and result.slot_of == {0: 0, 1: 1, 2: 0}
    assert result.pages_of == {0: [0], 1: [1], 2: [0]}
    for request in short[1:]:
        assert result.tokens[request.index] == alone(params, request, step="megakernel")


@pytest.fixture(scope="module")
def synthetic_data(params):
    requests = trace.synthetic_trace(3, n_requests=5, prompt_lens=(2, 12), output_lens=(2, 6),
                                     mean_gap=1.0, sampled_every=2)
    return requests, workload.run_workload(params, requests, CFG, PAGES, batch=BATCH,
                                           full_size="kimi-k3")


@pytest.mark.slow
def test_workload_data_on_a_synthetic_trace(synthetic_data):
    requests, data = synthetic_data
    summary, steps = data["summary"], data["steps"]
    assert [len(row["tokens"]) for row in data["requests"]] == [r.output_len for r in requests]
    assert summary["tokens"] == sum(r.output_len for r in requests)
    assert len(steps) == summary["decode_steps"] > 0
    for s in steps:
        assert 1 <= s["occupied"] <= BATCH and s["pages_filled"] <= s["pages_held"] <= 3
        context = workload.step_context(s["lengths"], PAGES.page_size)
        assert s["predicted_step_s"] == full_size_step("kimi-k3", batch=s["occupied"],
                                                       context=context).step_s  # one source
    assert 0 < summary["mean_slot_occupancy"] <= 1 and 0 < summary["mean_page_occupancy"] <= 1
    assert summary["predicted_seconds"] == pytest.approx(sum(s["predicted_step_s"] for s in steps))
    assert all(row["wait"] >= 0 and row["left"] >= row["joined"] for row in data["requests"])
    json.dumps(data)  # JSON-able


@pytest.mark.slow
def test_bench_workload_prints_the_table(synthetic_data, monkeypatch, capsys, tmp_path):
    _, data = synthetic_data
    served_args = {}

    def run_workload(params, requests, cfg, pages_config, **kwargs):
        served_args.update(requests=requests, pages=pages_config, **kwargs)
        for s in data["steps"]:  # each step's line is out as soon as its step ran
            kwargs["on_step"](s)
            assert capsys.readouterr().out.splitlines()[-1].startswith(f"{s['step']:>5} ")
        return data  # the data function is tested above: this is the command around it

    monkeypatch.setattr(cli_workload.workload, "run_workload", run_workload)
    path = tmp_path / "trace.csv"
    path.write_text("prompt_len,output_len,arrival,temperature\n5,4,0,\n7,3,2,0.5\n")
    assert cli.main(["bench", "--workload", str(path), "--slots", "2", "--pages", "6"]) == 0
    out = capsys.readouterr().out  # the totals (the steps' lines were read as they came)
    assert served_args["batch"] == 2 and served_args["pages"].n_pages == 6
    assert [r.temperature for r in served_args["requests"]] == [None, 0.5]
    assert "tokens/s" in out and "occupancy: slots" in out and len(out.splitlines()) == 3
    table = cli_workload.format_table(data).splitlines()
    assert "TPU ms" in table[1] and len(table) == len(data["steps"]) + 5


@pytest.mark.parametrize("content, reason", [
    (None, "cannot be read"),
    ("{not json", "is not valid JSON"),
    ('{"requests": [{"prompt_len": 5, "output_len": 0, "arrival": 0}]}',
     "workload 'trace.json' request 0: output_len=0 is invalid: an int >= 1"),
    ('[{"prompt_len": 5, "arrival": 0}]', "workload 'trace.json' request 0 lacks output_len"),
    ("prompt_len,output_len\n5,3\n", "CSV with a header naming prompt_len, output_len, arrival"),
    ("prompt_len,output_len,arrival\n100,40,0\n",
     "request 0: prompt_len + output_len = 140 exceeds max_seq_len=128 of the model"),
    ("prompt_len,output_len,arrival,temperature\n5,3,0,-1\n", "temperature='-1' is invalid"),
    # the edges: a value more (or fewer) than the header, a seed past uint32 (was refused 55 s
    # into the run, naming no request), a file that is not UTF-8
    ("prompt_len,output_len,arrival\n5,3,0\n5,3,0,7\n",
     "workload 'trace.json' line 3 is invalid: 4 values, the header names 3"),
    ("prompt_len,output_len,arrival\n5,3\n", "line 2 is invalid: 2 values, the header names 3"),
    ('[{"prompt_len": 5, "output_len": 3, "arrival": 0, "seed": 4294967296}]',
     "workload 'trace.json' request 0: seed=4294967296 is invalid: an int in [0, 4294967296)"),
    (b"prompt_len,output_len,arrival\n5,3,0 \xe9\n",
     "workload '{path}' is not UTF-8 text: byte 36 is 0xe9"),
])
def test_bad_trace_input_is_one_line(tmp_path, capsys, content, reason):
    path = tmp_path / "trace.json"
    if isinstance(content, str):
        path.write_text(content)
    elif content is not None:
        path.write_bytes(content)
    assert cli.main(["bench", "--workload", str(path)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and reason.format(path=path) in err, err


@pytest.mark.parametrize("options, reason", [
    (["--page-size", "0"], "--page-size must be an int >= 1"),  # was a ZeroDivisionError
    (["--page-size", "256"], "prompt_len + output_len = 140 exceeds max_seq_len=128"),
    (["--pages", "2", "--page-size", "32"],
     "its cache of prompt_len + output_len - 1 = 119 tokens exceeds the pool (2 pages of 32)"),
])
def test_bad_pool_options_are_one_line(tmp_path, capsys, options, reason):
    """--page-size 0, a row past the model's max_seq_len (a 256-token page table holds 140
    tokens, but `decode` refuses them) and one past the pool: one line, exit 2, before anything
    runs."""
    path = tmp_path / "trace.csv"
    output_len = 20 if "--pages" in options else 40
    path.write_text(f"prompt_len,output_len,arrival\n100,{output_len},0\n")
    assert cli.main(["bench", "--workload", str(path), *options]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and reason in err, err


def test_a_pool_the_device_cannot_hold_is_one_line(monkeypatch, capsys):
    """The device out of memory while serving (as a pool of 10^8 pages is on this machine):
    one line naming --pages and --page-size and the pool's bytes, exit 2."""
    def exhausted(*args, **kwargs):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 9 bytes.")

    monkeypatch.setattr(cli_workload.workload, "run_workload", exhausted)
    assert cli.main(["bench", "--workload", "synthetic", "--json"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert re.search(r"--pages 24 x --page-size 16: the KV page pool and the rows' states take "
                     r"[0-9.e+-]+ GB, more than the device could allocate", err), err


def test_trace_edges_read():
    """A JSON trace with a UTF-8 byte-order mark is JSON (was read as CSV); the pool check
    counts a request's cache as the allocator does (prompt + output - 1 tokens)."""
    text = '\ufeff[{"prompt_len": 20, "output_len": 13, "arrival": 0}]'
    (request,) = trace.parse_trace(text)
    assert request.length == 32
    loop.check_requests([request], paged_kv.PagedKVConfig(16, 2, 8), CFG)  # fills 2 pages
    with pytest.raises(ValueError, match=r"request 0: its cache of prompt_len \+ output_len - 1 "
                                         r"= 32 tokens exceeds one row's page table"):
        loop.check_requests([request], paged_kv.PagedKVConfig(16, 4, 1), CFG)


@pytest.mark.slow
def test_edges_of_a_run(params):
    """A request whose cache fills the pool exactly runs (was refused, the message blaming the
    page table); requests of one token end at their prefill: beside a running row they are in
    its step's joined and left lists (were joined only), and a trace of only such requests has
    no decode step and prints its table (was a crash on the median of no steps)."""
    full = paged_kv.PagedKVConfig(page_size=16, n_pages=2, max_pages_per_row=2)
    result = loop.serve(params, [Request(0, prompt_len=20, output_len=13, arrival=0)], CFG,
                        full, batch=BATCH)
    assert len(result.tokens[0]) == 13 and result.pages_of[0] == [0, 1]
    mixed = [Request(0, prompt_len=5, output_len=4, arrival=0),
             Request(1, prompt_len=5, output_len=1, arrival=1)]
    data = workload.run_workload(params, mixed, CFG, PAGES, batch=BATCH, full_size=None)
    step = next(s for s in data["steps"] if 1 in s["joined"])
    assert 1 in step["left"] and data["summary"]["ended_at_prefill"] == [1]
    ones = [Request(0, prompt_len=5, output_len=1, arrival=0),
            Request(1, prompt_len=3, output_len=1, arrival=2)]
    data = workload.run_workload(params, ones, CFG, PAGES, batch=BATCH, full_size="kimi-k3")
    assert data["steps"] == [] and data["summary"]["median_step_s_here"] is None
    table = cli_workload.format_table(data)
    assert "median step - s" in table and "done at their prefill (one token, no decode " \
        "step): 0,1" in table


@pytest.mark.slow
def test_the_serving_views_draw_the_data(synthetic_data):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from mkresearch.views import serve_plots
    from mkresearch.views.label_plots import label_problems

    _, data = synthetic_data
    owners = serve_plots.owner_matrix(data)
    assert owners.shape == (len(data["steps"]), PAGES.n_pages)
    assert serve_plots.occupancy_series(data)["slots"] == [s["occupied"] for s in data["steps"]]
    fig, (table_ax, occupancy_ax) = plt.subplots(2, 1, figsize=(10, 6.5), layout="constrained")
    serve_plots.plot_page_table(data, table_ax)
    serve_plots.plot_occupancy(data, occupancy_ax)
    assert not label_problems(fig)
    plt.close(fig)
