"""Tool calls (`rollout/tool_calls.py`) and tools (`rollout/tools.py`), the first pieces of
multi-turn rollouts.

Contracts:
- `parse_tool_calls` reads Qwen/Hermes `<tool_call>{json}</tool_call>` blocks (several per turn,
  `arguments` as an object or a JSON string) and returns the text around them; a malformed call
  (bad JSON, no name, arguments not an object, unclosed tag) becomes an error message, never a
  call;
- `load_tools` takes `module:function` strings or functions, describes each with the JSON
  schema chat templates take (`transformers.utils.get_json_schema`), and refuses an unknown
  module, a non-function, a nested function and an undocumented one, naming `tools[i]`;
- `ToolRunner.run` runs the calls in worker processes: results as JSON text, and unknown tools,
  missing or unknown arguments, exceptions and a call past its timeout as error messages for
  the model, each counted; after a timeout the next call runs in fresh workers.
Real processes, real transformers; nothing is faked.
"""

from __future__ import annotations

import pytest

from megatron_async_rl.config.errors import ConfigError
from megatron_async_rl.rollout.tool_calls import ToolCall, parse_tool_calls
from megatron_async_rl.rollout.tools import ToolRunner, load_tools
from tests.unit import tool_fixtures

ADD = "tests.unit.tool_fixtures:add"


def test_hermes_calls_and_the_text_around_them():
    text = ('Let me add. <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n'
            '</tool_call><tool_call>{"name": "add", "arguments": "{\\"a\\": 3, \\"b\\": 4}"}'
            "</tool_call> ok")  # fmt: skip
    turn = parse_tool_calls(text)
    assert turn.calls == [ToolCall("add", {"a": 1, "b": 2}), ToolCall("add", {"a": 3, "b": 4})]
    assert turn.text == "Let me add.  ok" and turn.errors == []
    assert parse_tool_calls("the answer is 7").calls == []


@pytest.mark.parametrize(
    "text, error",
    [
        ("<tool_call>{'name': 'add'}</tool_call>", "not JSON"),
        ('<tool_call>{"arguments": {}}</tool_call>', "needs a string 'name'"),
        ('<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>', "must be an object"),
        ('<tool_call>{"name": "add", "arguments": {"a": 1', "unclosed <tool_call>"),
    ],
)
def test_malformed_calls_are_errors_not_calls(text, error):
    turn = parse_tool_calls(text)
    assert turn.calls == [] and len(turn.errors) == 1 and error in turn.errors[0]
    with pytest.raises(ValueError, match="known formats are hermes"):
        parse_tool_calls(text, "llama9")


def test_a_whole_call_without_its_closing_tag_at_the_end_is_a_call():
    turn = parse_tool_calls('Adding. <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}')
    assert turn.calls == [ToolCall("add", {"a": 1, "b": 2})] and not turn.errors
    assert turn.text == "Adding."


def test_tools_load_with_their_schema():
    tools = load_tools([ADD, tool_fixtures.slow])
    assert sorted(tools) == ["add", "slow"]
    params = tools["add"].schema["function"]["parameters"]
    assert params["properties"]["a"] == {"type": "integer", "description": "the first number"}
    assert params["required"] == ["a", "b"]
    assert tools["slow"].spec == "tests.unit.tool_fixtures:slow"


@pytest.mark.parametrize(
    "spec, match",
    [
        ("no_such_module:f", r"tools\[0\] = 'no_such_module:f': cannot import it"),
        ("tests.unit.tool_fixtures:time", "is a module, not a function"),
        ("tests.unit.tool_fixtures:undocumented", "cannot describe it to the chat template"),
        (lambda x: x, "module-level function"),
        ("add", "must be module:function"),
    ],
)
def test_bad_tool_specs_name_the_key(spec, match):
    with pytest.raises(ConfigError, match=match):
        load_tools([spec])


def test_runner_turns_every_outcome_into_a_message():
    tools = load_tools([ADD, "tests.unit.tool_fixtures:slow", "tests.unit.tool_fixtures:broken"])
    runner = ToolRunner(tools, workers=2, timeout_s=3.0)
    try:
        out = runner.run([
            ToolCall("add", {"a": 40, "b": 2}),
            ToolCall("mul", {"a": 1}),
            ToolCall("add", {"a": 1}),
            ToolCall("add", {"a": 1, "b": 2, "c": 3}),
            ToolCall("broken", {"x": 5}),
        ])  # fmt: skip
        assert out[0] == "42"
        assert out[1].startswith("error: no tool named 'mul'; tools: add, broken, slow")
        assert out[2] == "error: add: missing argument(s) b"
        assert out[3].startswith("error: add: unknown argument(s) c")
        assert out[4] == "error: broken raised ValueError: broken on 5"
        runner.pool.call_timeout_s = 0.5
        (late,) = runner.run([ToolCall("slow", {"seconds": 30})])
        assert late == "error: slow did not answer within 0.5 s"
        runner.pool.call_timeout_s = 30.0
        assert runner.run([ToolCall("slow", {"seconds": 0})]) == ["slept"]  # fresh workers
        assert dict(runner.counts) == {"calls": 7, "unknown_tool": 1, "bad_arguments": 2,
                                       "raised": 1, "timeout": 1}  # fmt: skip
        runner.tools.update(load_tools(["tests.unit.tool_fixtures:huge"]))
        (big,) = runner.run([ToolCall("huge", {"n": 2**20})])  # 1 MB of text
        assert big == "x" * runner.max_chars + f"... [truncated: {2**20} characters in all]"
        assert runner.counts["truncated"] == 1
    finally:
        runner.close()


def test_workers_end_with_the_process_that_started_them(tmp_path):
    """A rank that ends with os._exit (Ctrl-C, preemption) never shuts its pool down: its
    workers must not outlive it."""
    import subprocess
    import sys
    import time

    import psutil

    code = (
        "import os, sys\n"
        "from megatron_async_rl.processes.worker_pool import WorkerPool\n"
        "from tests.unit.tool_fixtures import add\n"
        "pool = WorkerPool(workers=2)\n"
        "assert pool.run_many(add, [(1, 2), (3, 4)]) == [3, 7]\n"
        "print(' '.join(str(p.pid) for p in pool._pool._processes.values()), flush=True)\n"
        "os._exit(0)\n"
    )
    repo = str(tool_fixtures.__file__).rsplit("/tests/", 1)[0]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=repo)  # fmt: skip
    assert out.returncode == 0, out.stderr
    workers = [int(pid) for pid in out.stdout.split()]
    assert len(workers) == 2
    deadline = time.monotonic() + 10
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
              for p in workers):  # fmt: skip
        assert time.monotonic() < deadline, f"workers {workers} outlived their parent"
        time.sleep(0.2)


def test_callers_on_many_threads_share_the_workers_and_survive_a_replacement():
    """Every trajectory's environment calls the runner from its own thread: their calls run
    at once on the workers (the calls' own start and end stamps overlap), and a call of one
    caller that times out (its pool replaced) costs the other callers nothing."""
    import threading
    import time

    from megatron_async_rl.processes.worker_pool import CallTimeout, WorkerPool
    from tests.unit import tool_fixtures

    pool = WorkerPool(workers=4, call_timeout_s=20.0, what="test call")
    results = {}
    try:
        pool.run_many(tool_fixtures.stamped, [(0,)])  # workers up before the measured calls

        def call(name, seconds):
            results[name] = pool.run_many(tool_fixtures.stamped, [(seconds,)])[0]

        threads = [threading.Thread(target=call, args=(n, 1.0)) for n in "ab"]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        (a0, a1), (b0, b1) = results["a"], results["b"]
        assert a0 < b1 and b0 < a1, results  # they overlapped, not one after the other
        pool.call_timeout_s = 2.0
        threads = [threading.Thread(target=call, args=("hung", 60.0)),
                   threading.Thread(target=call, args=("fine", 3.5))]  # fmt: skip
        threads[0].start()
        time.sleep(0.5)  # the fine call starts on the pool the hung call will take down
        pool.call_timeout_s = 20.0
        threads[1].start()
        for t in threads:
            t.join()
        assert isinstance(results["hung"], CallTimeout)
        assert isinstance(results["fine"], list), results["fine"]  # run again, on the new pool
    finally:
        pool.close()
