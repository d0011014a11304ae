"""Leading as a service: campaign, lead, step down, campaign again — :class:`Elector`.

``Elector(coord, name, on_started, value=…, ttl=…).run()`` is client-go's ``LeaderElector`` and
kazoo's ``Election.run`` on fenced's terms: it campaigns for ``name``; once elected it calls
``on_started(leadership)`` with the term's :class:`~fenced.Leadership` (its fencing ``token``,
``term``, ``lost``/``ended`` events, ``check()``); when the term ends it calls ``on_stopped()``;
then it campaigns again, until :meth:`Elector.stop`. ``on_new_leader(change)`` is called for
every term anyone is elected to (its own included), from :meth:`~fenced.Coordinator.observe`.

Guarantees:

* **one term at a time**: ``on_started`` runs in a thread of its own (``fenced-leader:NAME``),
  and a new term is never campaigned for while the previous ``on_started`` is still running in
  this process;
* **on_stopped exactly once per term that started**, in the thread that called :meth:`run`, as
  soon as the term ends: lost (expired, refused, superseded: ``leadership.lost`` is set at the
  local deadline at the latest, even if a renewal hangs), or ended by this process
  (``on_started`` returned or raised, or :meth:`stop`: the term is resigned first, so the next
  candidate is elected at once). After a loss ``on_stopped`` does not wait for ``on_started``;
  the release is attempted after it;
* **loss is a signal, the fence is the guarantee**: a thread cannot be stopped from the outside,
  so ``on_started`` must watch ``leadership.ended`` (or call ``check()`` between steps) and return;
  until it does, its late writes are rejected by every store the next term installed itself at
  (``fence=[store]``), which is what makes them harmless;
* **stop() is final**: it ends the current term (resign, then ``on_stopped``) or the campaign,
  and returns once this elector holds no term and will start none (``run()`` returns once
  ``on_started`` has returned too). While campaigning, the stop takes effect within
  :data:`CAMPAIGN_SLICE` seconds: a candidate cannot be taken out of the coordinator's queue from
  another thread, so it queues for that long at a time and takes its place again (at the end of
  the line: among candidates that all re-queue, the order rotates and nobody is starved);
* **errors**: ``Unavailable``/``OutcomeUnknown`` while campaigning are retried with backoff (50 ms
  up to 2 s, logged); ``LeaseLost`` (from ``check()``) or ``StaleToken`` (a store saw a newer
  term) raised by ``on_started`` is how a demoted leader's work ends: the term ends and the
  elector campaigns again; any other exception from ``on_started`` or ``on_stopped`` ends the
  term and :meth:`run` re-raises it after ``on_stopped`` (a bug should not be hidden behind a
  re-election loop; client-go crashes the process); a store refusing to install the term
  (``StaleToken``, ``ForeignToken``) is raised by :meth:`run` at once. An exception from
  ``on_new_leader`` is logged and ignored: it is a notification.

Timeline of a pause (SIGSTOP) of the leader::

    t0  A leads: term 7 installed at the store; A's on_started writes with term 7
    t1  A is paused; B, campaigning, waits in the coordinator's queue
    t2  term 7 expires; B is elected (term 8), installs 8 at the store, B's on_started runs;
        every elector's on_new_leader gets term 8 (A's once it runs again)
    t3  A resumes: its watchdog sets lost (the local deadline passed); A's on_stopped runs;
        A's on_started sees ``ended``/``check()`` and returns; a write it made in between was
        rejected by the store (StaleToken)
    t4  A campaigns again, and queues behind B
"""

from __future__ import annotations

import contextlib
import enum
import logging
import random
import threading
from collections.abc import Callable, Iterable
from typing import Protocol

from fenced.core._errors import (
    Busy,
    ConfigurationError,
    LeaseLost,
    OutcomeUnknown,
    StaleToken,
    Unavailable,
)
from fenced.election._campaign import Campaign, Leadership
from fenced.election._observer import LeaderChange, LeaderChangeKind, Observer
from fenced.election._run import Campaigner
from fenced.runtime._hold import Fenceable

__all__ = ["CAMPAIGN_SLICE", "Elector", "Electorate"]

log = logging.getLogger("fenced.election")

CAMPAIGN_SLICE = 1.0
"""How long a campaigning :class:`Elector` queues before it takes its place again (seconds):
the longest a :meth:`Elector.stop` waits while campaigning."""
_BACKOFF_FIRST = 0.05
_BACKOFF_MAX = 2.0
_DEMOTED = (LeaseLost, StaleToken)
"""What ``on_started`` raises when its term is over: the elector campaigns again."""


class Electorate(Campaigner, Protocol):
    """What an :class:`Elector` needs of a coordinator (:class:`~fenced.Coordinator` has it)."""

    def observe(self, name: str) -> Observer: ...


class _State(enum.Enum):
    IDLE = "idle"  # run() not running
    CAMPAIGNING = "campaigning"
    LEADING = "leading"  # from the grant until on_stopped returned
    FINISHING = "finishing"  # the term is over; waiting for on_started to return


class _Outcome:
    """What ``on_started`` did: its exception, if any."""

    def __init__(self) -> None:
        self.error: BaseException | None = None


class Elector:
    """Campaign for ``name``, run ``on_started`` while leader, ``on_stopped`` after, again.

    ``on_started(leadership)`` runs in its own thread for the whole term: return (or raise) to
    step down. ``on_stopped()`` runs in the thread of :meth:`run`, once per term that started.
    ``on_new_leader(change)`` (a :class:`~fenced.LeaderChange` of kind ELECTED: ``term``,
    ``holder``, ``value``) runs in an observer thread, once per term, in term order, for every
    leader including this one; never after :meth:`run` returned. See the module docstring for
    the guarantees and the timeline of a pause.

    The other parameters are those of ``coord.campaign`` (``value``, ``ttl``, ``fence``,
    ``holder``, ``safety_margin``); they and the callbacks are validated here, before any I/O
    (:class:`~fenced.ConfigurationError`, :class:`~fenced.InvalidName`). Single use: :meth:`run`
    once, :meth:`stop` from anywhere (also a signal handler, or a callback).
    """

    def __init__(
        self,
        coord: Electorate,
        name: str,
        on_started: Callable[[Leadership], object],
        *,
        value: str,
        ttl: float,
        on_stopped: Callable[[], object] | None = None,
        on_new_leader: Callable[[LeaderChange], object] | None = None,
        fence: Iterable[Fenceable] = (),
        holder: str | None = None,
        safety_margin: float | None = None,
    ) -> None:
        for label, callback in (
            ("on_started", on_started),
            ("on_stopped", on_stopped),
            ("on_new_leader", on_new_leader),
        ):
            if callback is not None and not callable(callback):
                raise ConfigurationError(f"{label} must be callable")
        self._coord = coord
        self._name = name
        self._on_started = on_started
        self._on_stopped = on_stopped
        self._on_new_leader = on_new_leader
        self._value = value
        self._ttl = ttl
        self._fence = tuple(fence)
        self._holder = holder
        self._safety_margin = safety_margin
        self._campaign(threading.Event())  # validates every parameter; does no I/O
        self._lock = threading.RLock()  # an RLock: stop() may run in a signal handler
        self._state = _State.IDLE
        self._started = False
        self._stopping = threading.Event()
        self._quiet = threading.Event()
        self._wake: threading.Event | None = None
        self._leadership: Leadership | None = None
        self._threads: set[threading.Thread] = set()  # run()'s, on_started's, the observer's
        self._notify_lock = threading.Lock()
        self._observer: Observer | None = None
        self._rng = random.Random()

    @property
    def name(self) -> str:
        return self._name

    @property
    def leadership(self) -> Leadership | None:
        """The current term's leadership, from the grant until ``on_stopped`` returned."""
        with self._lock:
            return self._leadership

    # -- the loop -------------------------------------------------------------------------
    def run(self) -> None:
        """Campaign, lead, step down, and again, until :meth:`stop`; see the class docstring.

        Returns after :meth:`stop`, once ``on_started`` has returned. Raises what ``on_started``
        (other than :class:`~fenced.LeaseLost` and :class:`~fenced.StaleToken`, which end the
        term and lead to a new campaign) or ``on_stopped`` raised, after the term was
        released and ``on_stopped`` called; a store's refusal to install a term; and
        ``KeyboardInterrupt`` (after the same clean-up). ``RuntimeError`` if called twice.
        """
        closed = threading.Event()
        with self._lock:
            if self._started:
                raise RuntimeError("Elector.run() can be called only once")
            self._started = True
            self._threads.add(threading.current_thread())
            self._set_state(_State.CAMPAIGNING)
            if self._on_new_leader is not None:
                watcher = threading.Thread(
                    target=self._observe,
                    args=(closed,),
                    name=f"fenced-observer:{self._name}",
                    daemon=True,
                )
                self._threads.add(watcher)
                watcher.start()
        try:
            while not self._stopping.is_set():
                elected = self._campaign_until_elected()
                if elected is None:
                    break
                self._serve(*elected)
        finally:
            with self._notify_lock:  # no on_new_leader call starts after this
                closed.set()
                observer, self._observer = self._observer, None
            if observer is not None:
                observer.close()  # its thread ends within the observer's re-check period
            with self._lock:
                self._stopping.set()
                self._set_state(_State.IDLE)

    def stop(self, timeout: float | None = None) -> bool:
        """End the current term (resign, then ``on_stopped``) or the campaign, for good.

        Waits until this elector holds no term and will start none, at most ``timeout`` seconds
        (None: as long as it takes; while campaigning up to :data:`CAMPAIGN_SLICE`). Returns
        True if so, False on timeout. Called from a callback, from a signal handler in the
        thread of :meth:`run`, or before :meth:`run`, it only asks, and returns at once.
        Idempotent.
        """
        with self._lock:
            self._stopping.set()
            if self._state in (_State.IDLE, _State.FINISHING):
                self._quiet.set()
            wake = self._wake
            asking_only = threading.current_thread() in self._threads
        if wake is not None:
            wake.set()
        if asking_only:
            return self._quiet.is_set()
        return self._quiet.wait(timeout)

    # -- internals ------------------------------------------------------------------------
    def _set_state(self, state: _State) -> None:
        with self._lock:
            self._state = state
            if self._stopping.is_set() and state in (_State.IDLE, _State.FINISHING):
                self._quiet.set()

    def _campaign(self, wake: threading.Event) -> Campaign:
        return self._coord.campaign(
            self._name,
            self._value,
            self._ttl,
            wait=CAMPAIGN_SLICE,
            fence=self._fence,
            on_lost=lambda _error: wake.set(),
            holder=self._holder,
            safety_margin=self._safety_margin,
        )

    def _campaign_until_elected(self) -> tuple[Campaign, Leadership, threading.Event] | None:
        """Queue until elected (None once stopping); retries outages with backoff."""
        delay = _BACKOFF_FIRST
        while not self._stopping.is_set():
            wake = threading.Event()
            campaign = self._campaign(wake)
            try:
                leadership = campaign.__enter__()
            except Busy:  # a slice ran out: take our place again (or stop)
                continue
            except LeaseLost:  # the term expired while being installed at the stores
                continue
            except (Unavailable, OutcomeUnknown) as error:
                pause = delay * self._rng.uniform(0.8, 1.2)
                log.warning("campaigning for %s: %s; again in %.2fs", self._name, error, pause)
                self._stopping.wait(pause)
                delay = min(delay * 2, _BACKOFF_MAX)
                continue
            with self._lock:
                stopping = self._stopping.is_set()
                if not stopping:  # stop() from now on wakes this term
                    self._leadership, self._wake = leadership, wake
                    self._set_state(_State.LEADING)
            if not stopping:
                return campaign, leadership, wake
            leadership.resign()  # elected just as we were told to stop: on_started never ran
            campaign.__exit__(None, None, None)
        return None

    def _serve(self, campaign: Campaign, leadership: Leadership, wake: threading.Event) -> None:
        """One term: on_started in its thread; at the end on_stopped; wait for on_started."""
        outcome = _Outcome()
        worker = threading.Thread(
            target=self._lead, args=(leadership, outcome, wake), name=f"fenced-leader:{self._name}"
        )
        worker.daemon = True
        with self._lock:
            self._threads.add(worker)
        worker.start()
        interrupted: BaseException | None = None
        try:
            try:
                wake.wait()
            except BaseException as error:  # KeyboardInterrupt while waiting (main thread)
                interrupted = error
                self._stopping.set()
            self._end_term(campaign, leadership)
        finally:
            with self._lock:
                self._leadership = self._wake = None
                self._set_state(_State.FINISHING)
            self._await(worker, leadership)
            with self._lock:
                self._threads.discard(worker)
                if not self._stopping.is_set():
                    self._set_state(_State.CAMPAIGNING)
        if interrupted is not None:
            raise interrupted
        if outcome.error is not None and not isinstance(outcome.error, _DEMOTED):
            raise outcome.error

    def _lead(self, leadership: Leadership, outcome: _Outcome, wake: threading.Event) -> None:
        try:
            self._on_started(leadership)
        except BaseException as error:  # run() re-raises it, unless _DEMOTED
            outcome.error = error
            if isinstance(error, StaleToken):
                leadership.superseded(f"a store rejected term {leadership.term}: {error}")
        finally:
            wake.set()

    def _end_term(self, campaign: Campaign, leadership: Leadership) -> None:
        """Resign unless lost, call on_stopped, stop renewing (a lost term: after on_stopped)."""
        if not leadership.lost.is_set():
            leadership.resign()
        try:
            if self._on_stopped is not None:
                self._on_stopped()
        finally:
            with contextlib.suppress(LeaseLost):  # a lost term: on_stopped said so already
                campaign.__exit__(None, None, None)

    def _await(self, worker: threading.Thread, leadership: Leadership) -> None:
        """Join on_started's thread, warning every ttl while it outlives its term."""
        while True:
            worker.join(self._ttl)
            if not worker.is_alive():
                return
            log.warning(
                "on_started of %s term %d is still running after its term ended: it must watch "
                "leadership.ended (no new term starts until it returns)",
                self._name,
                leadership.term,
            )

    def _observe(self, closed: threading.Event) -> None:
        """The observer thread: on_new_leader for every ELECTED change, until closed."""
        delay = _BACKOFF_FIRST
        try:
            while True:
                try:
                    observer = self._coord.observe(self._name)
                    break
                except (Unavailable, OutcomeUnknown) as error:
                    log.warning("observing %s: %s; retrying", self._name, error)
                    if closed.wait(delay * self._rng.uniform(0.8, 1.2)):
                        return
                    delay = min(delay * 2, _BACKOFF_MAX)
            with self._notify_lock:
                if closed.is_set():
                    observer.close()
                    return
                self._observer = observer
            for change in observer:
                with self._notify_lock:
                    if closed.is_set():
                        return
                    if change.kind is LeaderChangeKind.ELECTED:
                        self._notify(change)
        except Exception:
            if not closed.is_set():
                log.exception("observing %s failed: on_new_leader will not be called", self._name)

    def _notify(self, change: LeaderChange) -> None:
        assert self._on_new_leader is not None
        try:
            self._on_new_leader(change)
        except Exception:
            log.exception("on_new_leader of %s (term %d) raised", self._name, change.term)

    def __repr__(self) -> str:
        return f"<Elector {self._name} {self._state.value}>"
