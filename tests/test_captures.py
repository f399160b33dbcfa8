"""What a function captures (module globals, closure cells, a bound method's ``self``) is
shipped with it once; when it changes, synk ships the function again, so that the workers
never compute with a stale copy while rank 0 uses the live one. Run as user scripts (the
function in ``__main__``, shipped by value), as a user's program would."""
import textwrap

from conftest import run_script

PREAMBLE = """
import warnings
import numpy as np
import synk
synk.fork(3, backend="cpu")
"""


def _run(tmp_path, body: str) -> str:
    return run_script(tmp_path / "script.py", PREAMBLE + textwrap.dedent(body)
                      + "\nsynk.close()\nprint('DONE')\n")


def test_a_rebound_global_is_shipped_again(tmp_path):
    out = _run(tmp_path, """
        W = np.arange(3.0)
        f = synk.function(lambda x: (x @ W).sum(), reduce="sum")
        x = np.ones((5, 3))
        print(f(x), (x @ W).sum())
        W = W * 2  # the issue's case: 45 where numpy gives 60 (or here 15 vs 30)
        print(f(x), (x @ W).sum())
    """)
    lines = out.split()
    assert lines[0] == lines[1] and lines[2] == lines[3], out


def test_a_small_global_array_changed_in_place_is_shipped_again(tmp_path):
    out = _run(tmp_path, """
        W = np.arange(3.0)
        def loss(x):
            return (x @ W).sum()
        f = synk.function(loss, reduce="sum")
        x = np.ones((5, 3))
        f(x)
        W *= 3
        W[0] = 7
        print(f(x) == (x @ W).sum())
    """)
    assert out.split()[0] == "True", out


def test_a_closure_variable_rebound_is_shipped_again(tmp_path):
    out = _run(tmp_path, """
        def make():
            scale = 1.0
            def fn(x):
                return x.sum() * scale
            def set_scale(v):
                nonlocal scale
                scale = v
            return fn, set_scale
        fn, set_scale = make()
        f = synk.function(fn, reduce="sum")
        x = np.ones((6, 2))
        f(x)
        set_scale(5.0)
        print(f(x))
    """)
    assert out.split()[0] == "60.0", out


def test_a_bound_method_sees_its_self_as_it_is(tmp_path):
    out = _run(tmp_path, """
        class Model:
            def __init__(self):
                self.w = [np.ones(2), np.ones(2)]
            def step(self, x):
                return (x @ self.w[0]).sum() + (x @ self.w[1]).sum()
        model = Model()
        f = synk.function(model.step, reduce="sum")
        x = np.ones((6, 2))
        first = f(x)
        model.w = [w * 2 for w in model.w]   # rebinding the attribute (Nielsen's update)
        second = f(x)
        model.w[0] += 1                        # in place, a small array
        third = f(x)
        print(first, second, third, model.step(x))
    """)
    first, second, third, want = out.split()[:4]
    assert (first, second) == ("24.0", "48.0") and third == want, out


def test_a_large_captured_array_is_warned_about_once(tmp_path):
    out = _run(tmp_path, """
        BIG = np.ones(100_000)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            f = synk.function(lambda x: x.sum() + BIG[0], reduce="sum")
            f(np.ones(6))
            f(np.ones(6))
        print(sum("may miss a change" in str(w.message) for w in caught))
        BIG = BIG * 3  # rebound: still seen
        print(f(np.ones(6)))
    """)
    count, value = out.split()[:2]
    assert count == "1" and value == "15.0", out


def test_unchanged_captures_are_not_shipped_again(tmp_path):
    # Shipping pickles what the function captures (in this process): the captured object
    # counts how often it is pickled, so a capture shipped again at each call shows.
    out = _run(tmp_path, """
        class Model:
            pickled = 0
            def __init__(self):
                self.w = np.arange(3.0)
            def __getstate__(self):
                Model.pickled += 1
                return self.__dict__
        M = Model()
        f = synk.function(lambda x: (x @ M.w).sum(), reduce="sum")
        results = [f(np.ones((4, 3))) for _ in range(5)]
        print(Model.pickled, *sorted(set(map(float, results))))
    """)
    assert out.split()[:3] == ["1", "12.0", "DONE"], out


def test_a_changed_global_of_an_imported_function_is_warned_about_at_the_call(tmp_path):
    """A function from an importable module goes by name: the workers import the module
    and keep their own globals, which synk cannot ship. A change is warned about at the
    call (once), saying what to do, never silently."""
    (tmp_path / "mymodel.py").write_text("import numpy as np\nW = np.arange(3.0)\n"
                                         "def loss(x):\n    return (x @ W).sum()\n")
    out = _run(tmp_path, """
        import sys, os
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import mymodel
        f = synk.function(mymodel.loss, reduce="sum")
        x = np.ones((5, 3))
        f(x)
        mymodel.W = mymodel.W * 2
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            f(x)
            f(x)
        said = [str(w.message) for w in caught if "the global 'W'" in str(w.message)]
        print("WARNED", len(said), "bcast_inputs" in said[0])
    """)
    assert "WARNED 1 True" in out, out
