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
