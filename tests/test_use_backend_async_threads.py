"""``use_backend`` as a decorator of coroutine, generator and async generator functions (the
backend applies around each step of the body, the caller's own between steps), and one object
used by several threads and asyncio tasks at once (the tokens are kept per context)."""

from __future__ import annotations

import asyncio
import inspect
import threading
import types

import pytest

import numstab as ns


@types.coroutine
def _suspend():
    """Suspend the awaiting coroutine once (a bare ``yield`` to whoever drives it)."""
    yield


def test_decorated_coroutine_runs_under_the_backend_at_every_step():
    log = []

    @ns.use_backend("jax")
    async def body(tag):
        """Doc."""
        log.append(ns.get_backend())
        await _suspend()
        log.append(ns.get_backend())
        with ns.use_backend("numpy"):  # the body's own block lasts across its awaits
            await _suspend()
            log.append(ns.get_backend())
        log.append(ns.get_backend())
        return tag

    assert inspect.iscoroutinefunction(body)
    assert body.__name__ == "body" and body.__doc__ == "Doc." and body.__wrapped__
    coro = body("done")
    with ns.use_backend("torch"):
        for _ in range(2):
            coro.send(None)
            assert ns.get_backend() == "torch"  # the caller's own choice between steps
        with pytest.raises(StopIteration) as stop:
            coro.send(None)
        assert ns.get_backend() == "torch"
    assert stop.value.value == "done"
    assert log == ["jax", "jax", "numpy", "jax"]
    assert ns.get_backend() == "auto"


def test_decorated_coroutine_under_asyncio_and_its_exceptions():
    @ns.use_backend("jax")
    async def step(delay):
        await asyncio.sleep(delay)
        if delay < 0.005:
            raise KeyError("boom")
        return ns.get_backend()

    async def main():
        with ns.use_backend("numpy"):
            out = await asyncio.gather(step(0.01), step(0.0), step(0.02), return_exceptions=True)
            return out, ns.get_backend()

    out, after = asyncio.run(main())
    assert out[0] == out[2] == "jax" and isinstance(out[1], KeyError) and after == "numpy"
    assert asyncio.run(step(0.01)) == "jax"
    assert ns.get_backend() == "auto"


def test_decorated_generator_runs_under_the_backend_at_every_resume():
    log = []

    @ns.use_backend("jax")
    def numbers():
        """Doc."""
        sent = yield ns.get_backend()
        with ns.use_backend("numpy"):
            yield sent, ns.get_backend()
            yield ns.get_backend()  # still the body's own block after the resume
        try:
            yield ns.get_backend()
        except KeyError:
            yield "caught", ns.get_backend()
        try:
            yield "last"
        finally:
            log.append(ns.get_backend())  # close() runs under the backend too
        return "unreached"

    assert inspect.isgeneratorfunction(numbers) and numbers.__doc__ == "Doc."
    with ns.use_backend("torch"):
        gen = numbers()
        assert next(gen) == "jax" and ns.get_backend() == "torch"
        assert gen.send("hi") == ("hi", "numpy") and ns.get_backend() == "torch"
        assert next(gen) == "numpy" and ns.get_backend() == "torch"
        assert next(gen) == "jax"
        assert gen.throw(KeyError("x")) == ("caught", "jax") and ns.get_backend() == "torch"
        assert next(gen) == "last"
        gen.close()
        assert log == ["jax"] and ns.get_backend() == "torch"
    assert ns.get_backend() == "auto"


def test_decorated_generator_returns_and_raises_through_yield_from():
    @ns.use_backend("jax")
    def inner():
        yield 1
        return ns.get_backend()

    @ns.use_backend("tensorflow")
    def failing():
        yield ns.get_backend()
        raise ValueError(ns.get_backend())

    def outer():
        result = yield from inner()
        yield result, ns.get_backend()

    assert list(outer()) == [1, ("jax", "auto")]
    gen = failing()
    assert next(gen) == "tensorflow"
    with pytest.raises(ValueError, match="tensorflow"):
        next(gen)
    assert ns.get_backend() == "auto"


def test_decorated_async_generator_runs_under_the_backend_at_every_step():
    log = []

    @ns.use_backend("jax")
    async def stream():
        """Doc."""
        sent = yield ns.get_backend()
        with ns.use_backend("numpy"):
            await asyncio.sleep(0)
            yield sent, ns.get_backend()
        try:
            yield ns.get_backend()
        except KeyError:
            yield "caught", ns.get_backend()
        try:
            yield "last"
        finally:
            await asyncio.sleep(0)
            log.append(ns.get_backend())

    async def main():
        assert inspect.isasyncgenfunction(stream) and stream.__doc__ == "Doc."
        with ns.use_backend("torch"):
            agen = stream()
            seen = [await agen.asend(None), ns.get_backend()]
            seen += [await agen.asend("hi"), ns.get_backend()]
            seen += [await agen.asend(None), await agen.athrow(KeyError("x"))]
            seen += [await agen.asend(None), ns.get_backend()]
            await agen.aclose()
            assert [item async for item in stream()] == ["jax", (None, "numpy"), "jax", "last"]
            return seen, ns.get_backend()

    seen, after = asyncio.run(main())
    expected = ["jax", "torch", ("hi", "numpy"), "torch", "jax", ("caught", "jax"), "last"]
    assert seen == [*expected, "torch"] and after == "torch"
    assert log == ["jax", "jax"]
    assert ns.get_backend() == "auto"


def test_decorated_generator_checks_the_name_when_it_starts():
    @ns.use_backend("nope")
    def gen():
        yield ns.get_backend()

    @ns.use_backend("nope")
    async def coro():
        return ns.get_backend()

    it = gen()  # decorating and calling check nothing: the body has not started
    with pytest.raises(ns.UnknownBackendError, match="nope"):
        next(it)
    with pytest.raises(ns.UnknownBackendError, match="nope"):
        asyncio.run(coro())
    assert ns.get_backend() == "auto"


def test_one_object_shared_by_concurrent_asyncio_tasks():
    shared = ns.use_backend("numpy")

    async def task(delay, name):
        with ns.use_backend(name):
            with shared:
                await asyncio.sleep(delay)
                inside = ns.get_backend()
            return inside, ns.get_backend()

    async def main():
        # the first task leaves its block while the second is still inside its own
        return await asyncio.gather(task(0.01, "jax"), task(0.05, "torch"))

    assert asyncio.run(main()) == [("numpy", "jax"), ("numpy", "torch")]
    assert ns.get_backend() == "auto"


def _overlapping(first, second):
    """Run ``first`` and ``second`` in two threads: both enter, then ``first`` leaves before
    ``second``. Each gets ``(wait_inside, done)``; returns what each returned or raised."""
    entered = [threading.Event(), threading.Event()]
    first_done = threading.Event()
    out = {}

    def run(key, fn, wait_inside):
        try:
            out[key] = fn(wait_inside)
        except Exception as exc:  # reported to the test below
            out[key] = f"{type(exc).__name__}: {exc}"

    def wait_first():
        entered[0].set()
        entered[1].wait(5)

    def wait_second():
        entered[1].set()
        first_done.wait(5)

    def first_then_signal(_):
        try:
            return first(wait_first)
        finally:
            first_done.set()

    a = threading.Thread(target=run, args=("first", first_then_signal, None))
    b = threading.Thread(target=run, args=("second", second, wait_second))
    a.start()
    entered[0].wait(5)
    b.start()
    a.join()
    b.join()
    return out["first"], out["second"]


def test_decorated_function_called_from_two_threads_at_once():
    @ns.use_backend("numpy")
    def work(wait_inside):
        wait_inside()
        return ns.get_backend()

    assert _overlapping(work, work) == ("numpy", "numpy")
    assert ns.get_backend() == "auto"


def test_one_object_entered_by_two_threads_at_once():
    shared = ns.use_backend("jax")

    def work(wait_inside):
        with shared:
            wait_inside()
            inside = ns.get_backend()
        return inside, ns.get_backend()

    assert _overlapping(work, work) == (("jax", "auto"), ("jax", "auto"))
    assert ns.get_backend() == "auto"


def test_exit_without_enter_is_a_clear_error():
    cm = ns.use_backend("numpy")
    with pytest.raises(RuntimeError, match=r"use_backend\('numpy'\) was exited .* not enter"):
        cm.__exit__(None, None, None)
    with cm:
        assert ns.get_backend() == "numpy"
    assert ns.get_backend() == "auto"
