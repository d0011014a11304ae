"""The network lab of real partitions (:mod:`fenced.testing.netlab`): namespaces, relays to
servers on loopback, nftables cuts and loss, and that nothing outlives a lab, even one whose
process was killed with SIGKILL.

Root only (CI runs as root); a test fails, never skips, without it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from fenced.testing.conformance import wait_for
from fenced.testing.netlab import HUB_MAC, PREFIX, NetLab, lab_namespaces, unavailable
from support.local_users import as_nobody

SRC = str(Path(__file__).resolve().parents[2] / "src")


@pytest.fixture(autouse=True)
def _root() -> None:
    why = unavailable()
    if why is not None:
        pytest.fail(f"the lab cannot be built: {why} (run the test suite as root, as CI does)")


def _echo_server() -> tuple[socket.socket, int]:
    """A loopback server that echoes every byte, on its own threads."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()

    def serve(conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(4096):
                conn.sendall(data)

    def accept() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return server, server.getsockname()[1]


@pytest.fixture
def echo_ports() -> Iterator[tuple[int, int]]:
    first, port1 = _echo_server()
    second, port2 = _echo_server()
    yield port1, port2
    first.close()
    second.close()


def _talk(lab: NetLab, host: int, server: str, timeout: float = 1.0) -> str:
    """From inside host ``host``: connect to ``server`` through the lab and echo a line;
    ``ok`` or the name of the exception."""
    address, port = lab.address(server)
    code = textwrap.dedent(
        f"""
        import socket
        try:
            s = socket.create_connection(({address!r}, {port}), timeout={timeout})
            s.sendall(b"ping")
            print("ok" if s.recv(4) == b"ping" else "wrong")
        except OSError as error:
            print(type(error).__name__)
        """
    )
    done = subprocess.run(
        lab.command(host, [sys.executable, "-c", code]),
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return done.stdout.strip()


def _links() -> set[str]:
    """The network interfaces of this (the root) namespace."""
    done = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True)
    return {line.split(":")[1].strip() for line in done.stdout.splitlines()}


def test_hosts_reach_servers_only_through_the_lab_and_nothing_is_left(
    echo_ports: tuple[int, int],
) -> None:
    links = _links()
    with NetLab(2, {"a": ("127.0.0.1", echo_ports[0]), "b": ("127.0.0.1", echo_ports[1])}) as lab:
        names = {lab.hub, lab.namespace(1), lab.namespace(2)}
        assert names <= set(lab_namespaces())
        assert _talk(lab, 1, "a") == "ok"
        assert _talk(lab, 2, "b") == "ok"
        assert _links() == links  # the lab's veths live in its namespaces only
        # the host's loopback is not reachable from inside: the lab has no way out
        inside = lab.command(1, [sys.executable, "-c", _connect_code("127.0.0.1", echo_ports[0])])
        done = subprocess.run(inside, capture_output=True, text=True, timeout=30, check=True)
        assert done.stdout.strip() == "ConnectionRefusedError"
    assert not names & set(lab_namespaces())
    assert _links() == links


def _connect_code(host: str, port: int) -> str:
    return textwrap.dedent(
        f"""
        import socket
        try:
            socket.create_connection(({host!r}, {port}), timeout=1).close()
            print("connected")
        except OSError as error:
            print(type(error).__name__)
        """
    )


def test_a_cut_from_one_server_keeps_the_other_and_heal_restores_it(
    echo_ports: tuple[int, int],
) -> None:
    with NetLab(2, {"a": ("127.0.0.1", echo_ports[0]), "b": ("127.0.0.1", echo_ports[1])}) as lab:
        lab.cut(1, "a")
        assert _talk(lab, 1, "a") == "TimeoutError"  # silence, as a partition looks to TCP
        assert _talk(lab, 1, "b") == "ok"
        assert _talk(lab, 2, "a") == "ok"  # only host 1 is cut
        lab.cut(1)
        assert _talk(lab, 1, "b") == "TimeoutError"
        lab.heal(1)
        assert _talk(lab, 1, "a") == "ok"
        assert _talk(lab, 1, "b") == "ok"
        lab.loss(2, 100)
        assert _talk(lab, 2, "a") == "TimeoutError"
        lab.heal(2)
        assert _talk(lab, 2, "a") == "ok"


def test_an_established_connection_goes_silent_and_resumes_after_heal(
    echo_ports: tuple[int, int],
) -> None:
    with NetLab(1, {"a": ("127.0.0.1", echo_ports[0])}) as lab:
        address, port = lab.address("a")
        code = textwrap.dedent(
            f"""
            import socket, sys
            s = socket.create_connection(({address!r}, {port}), timeout=5)
            s.sendall(b"1"); assert s.recv(1) == b"1"
            print("connected", flush=True)
            sys.stdin.readline()  # the test cuts the host now
            s.settimeout(0.5)
            s.sendall(b"2")
            try:
                s.recv(1)
                print("answered during the cut", flush=True)
            except TimeoutError:
                print("silent", flush=True)
            sys.stdin.readline()  # healed: TCP retransmits, the echo arrives
            s.settimeout(10)
            print("resumed" if s.recv(1) == b"2" else "wrong", flush=True)
            """
        )
        with subprocess.Popen(
            lab.command(1, [sys.executable, "-c", code]),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        ) as child:
            assert child.stdin is not None and child.stdout is not None
            assert child.stdout.readline().strip() == "connected"
            lab.cut(1, "a")
            child.stdin.write("\n")
            child.stdin.flush()
            assert child.stdout.readline().strip() == "silent"
            lab.heal(1)
            child.stdin.write("\n")
            child.stdin.flush()
            assert child.stdout.readline().strip() == "resumed"
            assert child.wait(30) == 0


def _bridge_mac(lab: NetLab) -> str:
    done = subprocess.run(
        ["ip", "-n", lab.hub, "-o", "link", "show", "br0"],
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.split("link/ether")[1].split()[0]


def test_hosts_joining_leave_the_connections_of_the_others_flowing(
    echo_ports: tuple[int, int],
) -> None:
    """The bridge keeps its link address (:data:`HUB_MAC`) as hosts join: left to the kernel,
    it took a joining host's lower address, and the hosts that had cached the old one fell
    silent until ARP resolved it again (up to a minute; verify's workers stalled after every
    replacement of a killed one)."""
    with NetLab(3, {"a": ("127.0.0.1", echo_ports[0])}) as lab:
        assert _bridge_mac(lab) == HUB_MAC
        address, port = lab.address("a")
        code = textwrap.dedent(
            f"""
            import socket, sys, time
            s = socket.create_connection(({address!r}, {port}), timeout=5)
            s.settimeout(2.0)  # the silence of the defect lasted seconds to a minute
            print("connected", flush=True)
            silent = 0
            while not sys.stdin.readline().strip():  # the test says "stop" when done
                try:
                    s.sendall(b"x")
                    s.recv(1)
                except TimeoutError:
                    silent += 1
                    break
            print("silent" if silent else "flowing", flush=True)
            """
        )
        with contextlib.ExitStack() as stack:
            children = [
                stack.enter_context(
                    subprocess.Popen(
                        lab.command(host, [sys.executable, "-c", code]),
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        text=True,
                    )
                )
                for host in (1, 2, 3)
            ]
            for child in children:
                stack.callback(child.kill)  # runs before each Popen's exit waits for it
            for child in children:
                assert child.stdout is not None and child.stdout.readline().strip() == "connected"
            for _ in range(24):  # each joins with a random address: some lower than all before
                lab.add_host()
                for child in children:  # one round trip of every old host after each join
                    assert child.stdin is not None
                    child.stdin.write("\n")
                    child.stdin.flush()
            assert _bridge_mac(lab) == HUB_MAC
            said = []
            for child in children:
                assert child.stdin is not None and child.stdout is not None
                child.stdin.write("stop\n")
                child.stdin.flush()
                said.append(child.stdout.readline().strip())
            assert said == ["flowing"] * 3


def test_the_lab_of_a_process_killed_with_sigkill_is_removed_at_the_next_start(
    echo_ports: tuple[int, int],
) -> None:
    code = textwrap.dedent(
        f"""
        import sys, time
        sys.path.insert(0, {SRC!r})
        from fenced.testing.netlab import NetLab
        lab = NetLab(2, {{"a": ("127.0.0.1", {echo_ports[0]})}}).start()
        print(lab.name, flush=True)
        time.sleep(600)
        """
    )
    with subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) as child:
        assert child.stdout is not None
        name = child.stdout.readline().strip()
        assert name.startswith(f"{PREFIX}{child.pid}-")
        theirs = {n for n in lab_namespaces() if n.startswith(name + "-")}
        assert len(theirs) == 3  # hub and two hosts
        os.kill(child.pid, signal.SIGKILL)
        child.wait(30)
    assert theirs <= set(lab_namespaces())  # SIGKILL left them
    with NetLab(1, {"a": ("127.0.0.1", echo_ports[0])}) as lab:
        assert not theirs & set(lab_namespaces())  # reaped when this lab started
        assert _talk(lab, 1, "a") == "ok"
    wait_for(lambda: not theirs & set(lab_namespaces()), 5, "the dead lab to stay gone")


def test_without_root_it_says_so_in_one_line() -> None:
    said = as_nobody(
        f"""
        import sys
        sys.path.insert(0, {SRC!r})
        from fenced.testing.netlab import unavailable
        print(unavailable())
        """
    )
    assert said == "network partitions need root (network namespaces and nftables)\n"


def test_hosts_and_relays_added_to_a_running_lab(echo_ports: tuple[int, int]) -> None:
    with NetLab() as lab:
        assert lab.hosts == 0
        first = lab.add_host()
        lab.add_relay("a", "127.0.0.1", echo_ports[0])
        lab.add_relay("b", "127.0.0.1", echo_ports[1])
        second = lab.add_host()
        assert (first, second) == (1, 2)
        assert _talk(lab, second, "b") == "ok"
        lab.cut(second, "a", "b")
        assert _talk(lab, second, "a") == "TimeoutError"
        assert _talk(lab, second, "b") == "TimeoutError"
        assert _talk(lab, first, "a") == "ok"
        with pytest.raises(ValueError, match="already relays"):
            lab.add_relay("a", "127.0.0.1", echo_ports[1])
        names = {lab.hub, lab.namespace(1), lab.namespace(2)}
    assert not names & set(lab_namespaces())


def _connect_from(lab: NetLab, host: int, address: str, port: int) -> str:
    """From inside host ``host``: connect to ``address:port``; ``ok`` or the error's name."""
    code = _connect_code(address, port).replace('print("connected")', 'print("ok")')
    done = subprocess.run(
        lab.command(host, [sys.executable, "-c", code]),
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return done.stdout.strip()


def test_a_server_inside_a_host_is_exposed_on_loopback_and_isolated_from_the_others() -> None:
    server = textwrap.dedent(
        """
        import socket, sys, threading
        listener = socket.create_server((sys.argv[1], 7000))
        print("ready", flush=True)
        def serve(conn):
            with conn:
                while data := conn.recv(4096):
                    conn.sendall(data)
        while True:
            conn, _ = listener.accept()
            threading.Thread(target=serve, args=(conn,), daemon=True).start()
        """
    )
    with NetLab(2) as lab:
        inside = lab.host_address(1)
        with subprocess.Popen(
            lab.command(1, [sys.executable, "-c", server, inside]),
            stdout=subprocess.PIPE,
            text=True,
        ) as child:
            assert child.stdout is not None
            assert child.stdout.readline().strip() == "ready"
            try:
                relay = lab.expose(1, 7000)

                def echo() -> bytes:
                    with socket.create_connection(("127.0.0.1", relay.port), timeout=5) as s:
                        s.sendall(b"ping")
                        return s.recv(4)

                assert echo() == b"ping"
                assert _connect_from(lab, 2, inside, 7000) == "ok"
                lab.isolate(1, 2)
                assert _connect_from(lab, 2, inside, 7000) == "TimeoutError"
                assert echo() == b"ping"  # the relay still reaches it: clients are not cut
                lab.heal(1)
                assert _connect_from(lab, 2, inside, 7000) == "ok"
            finally:
                child.kill()
        with pytest.raises(ValueError, match="isolate from which hosts"):
            lab.isolate(1)
