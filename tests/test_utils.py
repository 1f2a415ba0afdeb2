"""titan_ds.utils: the rendezvous port."""
import socket

from titan_ds import utils


def test_free_port_is_below_the_ephemeral_range_and_bindable():
    """A port from ``bind(0)`` lies in the kernel's ephemeral range, where an outgoing connection can take it
    before the store listens (CI once failed with EADDRINUSE); free_port picks below that range."""
    lo, _ = utils._ephemeral_range()
    ports = {utils.free_port() for _ in range(20)}
    assert all(1024 <= p < lo for p in ports), ports
    assert len(ports) > 1  # random, so two jobs started together rarely pick the same one
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))


def test_free_port_falls_back_on_the_kernel_when_every_probe_is_taken(monkeypatch):
    real = socket.socket

    class Taken(real):
        def bind(self, addr):
            if addr[1] != 0:
                raise OSError(98, "address already in use")
            return super().bind(addr)

    monkeypatch.setattr(utils.socket, "socket", Taken)
    assert utils.free_port() >= 1024


def test_a_launch_that_lost_its_port_is_retried_on_a_new_one_and_nothing_else_is(tmp_path):
    """The probe releases the port before the ranks bind it, so another worker's launch can take it in between
    (CI failed once with EADDRINUSE): the test launcher retries that failure on a fresh port, and only that."""
    import sys

    from tests.helpers.launch import run_on_free_port

    ports = []

    def lost_once(port):
        ports.append(port)
        msg = "EADDRINUSE: address already in use" if len(ports) == 1 else "ok"
        return [sys.executable, "-c", f"import sys; print({msg!r}); sys.exit({int(len(ports) == 1)})"]

    p = run_on_free_port(lost_once, timeout=60)
    assert p.returncode == 0 and p.stdout.strip() == "ok" and len(ports) == 2

    calls = []

    def fails(port):
        calls.append(port)
        return [sys.executable, "-c", "import sys; sys.stderr.write('boom'); sys.exit(3)"]

    p = run_on_free_port(fails, timeout=60)
    assert p.returncode == 3 and len(calls) == 1  # a real failure is not hidden by retries

    taken = []
    p = run_on_free_port(lambda port: taken.append(port) or [sys.executable, "-c",
                                                             "import sys; sys.exit('Address already in use')"],
                         attempts=2, timeout=60)
    assert p.returncode == 1 and len(taken) == 2  # gives up after `attempts`, returning the last failure
