"""An error found by any rank is printed once per node (`errors.first_report_on_node`).

Contract: outside torchrun every call reports; under torchrun (RANK set) the first process of a
torchrun agent (same parent) to report a message does, later ones with the same message do not,
and a different message is reported again. Nothing is faked but the environment variable.
"""

from megatron_async_rl.config.errors import first_report_on_node


def test_once_per_node_and_message(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert first_report_on_node("a") and first_report_on_node("a")
    monkeypatch.setenv("RANK", "3")
    message = f"config error: unique {id(monkeypatch)}"
    assert first_report_on_node(message) is True
    assert first_report_on_node(message) is False  # another rank of the same agent, same error
    assert first_report_on_node(message + " (another)") is True
