"""Forces the interleaving a missing lock would allow, so a thread-safety test can fail.

A race between threads is rare by chance. Here each racing thread, once it read the state a
critical section checks, pauses right there (still holding the object's lock, if any) until
every other racer either got into the same section too (possible only if nothing excludes it),
is blocked on the object's lock (the section is exclusive), or is done. With a lock, the racers
take turns; without one, they all read the same state before any of them writes, every time.

The object's lock is wrapped by `WatchedLock`, which tells the race when a racer finds it
taken; the pause points are hooks on what the section reads (`pause_on_read`, or a mapping
whose get() pauses). No wait here is a timing assumption: a racer waits for another's state,
bounded only against a hang (HANG_S).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

#: A racer that waits this long for the others is reported hung (a bug, not a slow machine).
HANG_S = 20.0


class Race:
    """Racing threads by name; `patient` racers inside a section wait for the others to be
    blocked or done (not merely inside too), so that theirs is the last write."""

    def __init__(self, patient: Iterable[str] = ()) -> None:
        self._cond = threading.Condition()
        self._names: dict[int, str] = {}
        self._inside: set[str] = set()
        self._blocked: set[str] = set()
        self._done: set[str] = set()
        self._patient = set(patient)
        self.hung: list[str] = []

    def enter(self, name: str) -> None:
        """The calling thread races as `name` from now on."""
        with self._cond:
            self._names[threading.get_ident()] = name

    def finish(self) -> None:
        """The calling thread's racing is over (whatever happened to it)."""
        with self._cond:
            self._done.add(self._names[threading.get_ident()])
            self._cond.notify_all()

    def _me(self) -> str | None:
        return self._names.get(threading.get_ident())

    def blocked(self) -> None:
        """The calling racer found the object's lock taken."""
        with self._cond:
            me = self._me()
            if me is not None:
                self._blocked.add(me)
                self._cond.notify_all()

    def pause(self) -> None:
        """Called inside the critical section: waits there for the other racers (once per racer)."""
        with self._cond:
            me = self._me()
            if me is None or me in self._inside or me in self._done:
                return
            self._inside.add(me)
            self._cond.notify_all()
            others = set(self._names.values()) - {me}
            let_in = set() if me in self._patient else self._inside

            def ready() -> bool:
                return all(o in self._blocked or o in self._done or o in let_in for o in others)

            if not self._cond.wait_for(ready, timeout=HANG_S):
                self.hung.append(me)

    def inside(self) -> set[str]:
        """The racers that got into the section."""
        with self._cond:
            return set(self._inside)


class WatchedLock:
    """Wraps an object's lock (or whatever stands in its place): tells the race when a racer
    finds it taken, then waits for it as the object would."""

    def __init__(self, inner: Any, race: Race) -> None:
        self.inner = inner
        self.race = race

    def __enter__(self) -> WatchedLock:
        acquire = getattr(self.inner, "acquire", None)
        if acquire is None:  # not a lock: enter it as it is
            self.inner.__enter__()
        elif not acquire(blocking=False):
            self.race.blocked()
            acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        release = getattr(self.inner, "release", None)
        if release is None:
            self.inner.__exit__(*exc)
        else:
            release()


class PauseOnRead:
    """A class attribute that pauses the racer reading it (the value is read before the pause,
    as the section's check reads it); stores like the attribute it replaces."""

    def __init__(self, original: Any, name: str, race: Race) -> None:
        self.original = original  # a slot's member descriptor, or None for a plain instance attribute
        self.name = name
        self.race = race

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        if obj is None:
            return self
        value = self.original.__get__(obj, owner) if self.original is not None else obj.__dict__[self.name]
        self.race.pause()
        return value

    def __set__(self, obj: Any, value: Any) -> None:
        if self.original is not None:
            self.original.__set__(obj, value)
        else:
            obj.__dict__[self.name] = value


def pause_on_read(monkeypatch: Any, cls: type, name: str, race: Race) -> None:
    """Makes every read of `cls`'s attribute `name` a pause point of `race` (for the test's duration)."""
    original = cls.__dict__.get(name)
    monkeypatch.setattr(cls, name, PauseOnRead(original, name, race), raising=False)


class PausingDict(dict):
    """A mapping whose reads, get() and a subscript, pause the racer calling it, after reading."""

    def __init__(self, data: dict, race: Race) -> None:
        super().__init__(data)
        self.race = race

    def get(self, key: Any, default: Any = None) -> Any:
        value = super().get(key, default)
        self.race.pause()
        return value

    def __getitem__(self, key: Any) -> Any:
        value = super().__getitem__(key)
        self.race.pause()
        return value


def run_racers(race: Race, racers: dict[str, Any]) -> dict[str, Any]:
    """Runs each `racers[name]()` in its own thread, all released at once; name -> what it
    returned, or the exception it raised."""
    results: dict[str, Any] = {}
    start = threading.Barrier(len(racers))

    def run(name: str, call: Any) -> None:
        race.enter(name)
        try:
            start.wait(HANG_S)
            results[name] = call()
        except BaseException as exc:  # handed to the test as the result
            results[name] = exc
        finally:
            race.finish()

    threads = [threading.Thread(target=run, args=item, daemon=True) for item in racers.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(3 * HANG_S)
    assert not any(t.is_alive() for t in threads), "a racer hung"
    assert race.hung == [], f"racers {race.hung} waited {HANG_S:g}s for the others"
    return results
