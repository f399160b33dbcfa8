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
synk.fork({ranks}, backend="cpu")
"""


def _run(tmp_path, body: str, ranks: int = 3) -> str:
    return run_script(tmp_path / "script.py", PREAMBLE.format(ranks=ranks)
                      + textwrap.dedent(body) + "\nsynk.close()\nprint('DONE')\n")


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


# One rule for everything reachable from the function. Each test changes, between
# two calls, something the function reaches, and checks that every rank (rank 0 runs the
# live function, the others the shipped copy) computes with the live value.

def _said(out: str, label: str) -> list:
    """The words the script printed after ``label`` (on the line starting with it)."""
    line = next((line for line in out.splitlines() if line.split()[:1] == [label]), None)
    assert line is not None, out
    return line.split()[1:]


def _every_rank(tmp_path, body: str) -> list:
    """Run ``body`` on 2 ranks; it prints ``SEEN``, then a call's per-rank results (reduce
    None) and the live value: return those words."""
    return _said(_run(tmp_path, body, ranks=2), "SEEN")


def test_item_99_of_a_long_global_list(tmp_path):
    seen = _every_rank(tmp_path, """
        LONG = list(range(100))
        f = synk.function(lambda: LONG[99], reduce=None)
        f()
        LONG[99] = -1
        print("SEEN", *f(), LONG[99])
    """)
    assert seen == ["-1"] * 3, seen


def test_a_value_four_levels_down_a_global_dict(tmp_path):
    seen = _every_rank(tmp_path, """
        CONFIG = {"model": {"layers": {"head": {"scale": 1.0}}}}
        def scale():
            return CONFIG["model"]["layers"]["head"]["scale"]
        f = synk.function(scale, reduce=None)
        f()
        CONFIG["model"]["layers"]["head"]["scale"] = 2.5
        print("SEEN", *f(), scale())
    """)
    assert seen == ["2.5"] * 3, seen


def test_a_large_array_inside_a_global_list_is_warned_about_when_shipped(tmp_path):
    """A 40 KB array is checked by a sample: synk says so when it ships the function,
    naming the array, before any change can go unseen; a change at a sampled element (the
    first and last always are) is seen."""
    out = _run(tmp_path, ranks=2, body="""
        W = np.zeros(5000)
        PARAMS = [W]
        f = synk.function(lambda: float(PARAMS[0].sum()), reduce=None)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            f()
            f()
        said = [str(w.message) for w in caught if "may miss a change" in str(w.message)]
        print("WARNED", len(said), "PARAMS" in said[0], "40000 bytes" in said[0],
              "bcast_inputs" in said[0] and "synk.shared" in said[0])
        PARAMS[0][0] = 7
        print("SEEN", *f(), float(PARAMS[0].sum()))
    """)
    assert _said(out, "WARNED") == ["1", "True", "True", "True"], out
    assert _said(out, "SEEN") == ["7.0"] * 3, out


def test_a_large_value_the_function_changes_itself_is_not_warned_about(tmp_path):
    """A large array the function itself writes at each call (its ranks' state, as a torch
    step's model is) is not warned about; one it only reads still is, after the first
    call, pointing at the script's line."""
    out = _run(tmp_path, ranks=2, body="""
        STATE = np.zeros(5000)
        READ = np.ones(5000)
        def step(x):
            STATE[...] += x.sum()  # each rank's own running total
            return float(STATE[0] + READ[0])
        f = synk.function(step, reduce=None)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            first = f(np.ones(4))
            second = f(np.ones(4))
        said = [w for w in caught if "may miss a change" in str(w.message)]
        print("WARNED", len(said), "READ" in str(said[0].message),
              "STATE" in str(said[0].message), said[0].filename.endswith("script.py"))
        print("VALUES", *first, *second)
    """)
    assert _said(out, "WARNED") == ["1", "True", "False", "True"], out
    assert _said(out, "VALUES") == ["3.0", "3.0", "5.0", "5.0"], out


def test_an_attribute_of_a_global_simple_namespace(tmp_path):
    seen = _every_rank(tmp_path, """
        from types import SimpleNamespace
        cfg = SimpleNamespace(lr=1)
        f = synk.function(lambda: cfg.lr, reduce=None)
        f()
        cfg.lr = 2
        print("SEEN", *f(), cfg.lr)
    """)
    assert seen == ["2"] * 3, seen


def test_a_class_attribute_of_a_script_class(tmp_path):
    seen = _every_rank(tmp_path, """
        class Settings:
            lr = 1
        def lr():
            return Settings.lr
        f = synk.function(lr, reduce=None)
        f()
        Settings.lr = 2
        print("SEEN", *f(), lr())
    """)
    assert seen == ["2"] * 3, seen


def test_an_item_added_to_a_global_set(tmp_path):
    seen = _every_rank(tmp_path, """
        TAGS = {1, 2}
        f = synk.function(lambda: len(TAGS), reduce=None)
        f()
        TAGS.add(3)
        print("SEEN", *f(), len(TAGS))
    """)
    assert seen == ["3"] * 3, seen


def test_an_attribute_of_an_attribute_of_a_bound_methods_object(tmp_path):
    """``self.opt.lr``, with ``self`` a plain object and one with ``__slots__``."""
    out = _run(tmp_path, ranks=2, body="""
        class Optimizer:
            def __init__(self):
                self.lr = 0.1
        class Model:
            def __init__(self):
                self.opt = Optimizer()
            def step(self):
                return self.opt.lr
        class Slotted(Model):
            __slots__ = ("opt",)
        for label, model in (("PLAIN", Model()), ("SLOTS", Slotted())):
            f = synk.function(model.step, reduce=None)
            f()
            model.opt.lr = 0.01
            print(label, *f(), model.step())
    """)
    assert _said(out, "PLAIN") == ["0.01"] * 3, out
    assert _said(out, "SLOTS") == ["0.01"] * 3, out


def test_a_mutable_default_argument(tmp_path):
    out = _run(tmp_path, ranks=2, body="""
        def scaled(options={"scale": 1}, *, extra=[0]):
            return options["scale"] + sum(extra)
        f = synk.function(scaled, reduce=None)
        f()
        scaled.__defaults__[0]["scale"] = 5
        print("SEEN", *f(), scaled())
        scaled.__kwdefaults__["extra"].append(10)
        print("KWDEFAULT", *f(), scaled())
    """)
    assert _said(out, "SEEN") == ["5"] * 3, out
    assert _said(out, "KWDEFAULT") == ["15"] * 3, out


def test_every_kind_of_reachable_object_is_followed(tmp_path):
    """The rule has no list of cases: whatever the function reaches by value is compared.
    A closure's list, a partial's keyword argument, a lambda kept in a global list, an
    object with __slots__, a callable object's attribute, a class attribute read through
    an instance, an object with its own __getstate__, a list inside a tuple, and a C-level
    object compared by its pickled bytes (a random.Random: rank 0's draws move its state,
    so every rank draws the same next number)."""
    out = _run(tmp_path, ranks=2, body="""
        import functools, random

        def check(label, fn, change):
            f = synk.function(fn, reduce=None)
            f()
            change()
            print(label, *f(), fn())

        def make():
            history = [1]
            return (lambda: sum(history)), history
        closure, history = make()
        check("CLOSURE", closure, lambda: history.append(10))

        def scaled(x, *, table):
            return x * table["k"]
        part = functools.partial(scaled, 2, table={"k": 1})
        check("PARTIAL", part, lambda: part.keywords["table"].update(k=3))

        SCALE = 2
        HOOKS = [lambda: SCALE * 10]
        check("LAMBDA_IN_LIST", lambda: HOOKS[0](), lambda: globals().update(SCALE=5))

        class Slotted:
            __slots__ = ("value",)
        SLOT = Slotted()
        SLOT.value = 1
        check("SLOTS", lambda: SLOT.value, lambda: setattr(SLOT, "value", 4))

        class Scaler:
            def __init__(self):
                self.k = 1
            def __call__(self):
                return self.k
        scaler = Scaler()
        check("CALLABLE", scaler, lambda: setattr(scaler, "k", 6))

        class Layer:
            width = 3
            def size(self):
                return self.width
        layer = Layer()
        check("CLASS_VIA_SELF", layer.size, lambda: setattr(Layer, "width", 7))

        class Stateful:
            def __init__(self):
                self.v = 1
            def __getstate__(self):
                return dict(self.__dict__)
        STATE = Stateful()
        check("GETSTATE", lambda: STATE.v, lambda: setattr(STATE, "v", 8))

        PAIR = ("fixed", [1])
        check("TUPLE", lambda: sum(PAIR[1]), lambda: PAIR[1].append(8))

        RNG = random.Random(0)
        check("C_OBJECT", lambda: RNG.random(), lambda: None)
    """)
    for label, want in (("CLOSURE", "11"), ("PARTIAL", "6"), ("LAMBDA_IN_LIST", "50"),
                        ("SLOTS", "4"), ("CALLABLE", "6"), ("CLASS_VIA_SELF", "7"),
                        ("GETSTATE", "8"), ("TUPLE", "9")):
        assert _said(out, label) == [want] * 3, (label, out)
    first, second, live = _said(out, "C_OBJECT")
    assert first == second and first != live, out  # (fn() drew the next number after)


def test_a_value_rebound_to_an_equal_one_is_not_shipped_again(tmp_path):
    """The comparison is exact, not fussy: a number rebound to an equal one (a new object)
    ships nothing, a bound method's object left alone neither; a different value ships the
    function again. Counted on the workers: each unpickles the probe once per shipping."""
    out = _run(tmp_path, ranks=2, body="""
        import os
        LOG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "unpickled")
        class Probe:
            def __init__(self):
                self.alive = True  # (an object with no state is not unpickled by setstate)
            def __setstate__(self, state):
                with open(LOG, "a") as f:
                    f.write("x")
                self.__dict__.update(state)
        class Model:
            def __init__(self):
                self.probe = Probe()
                self.lr = 0.5
            def step(self):
                return self.lr * RATE
        RATE = 2.0
        model = Model()
        f = synk.function(model.step, reduce=None)
        results = []
        for i in range(5):
            RATE = float(str(2.0))  # equal, a new object
            results += f()
        print("SAME", open(LOG).read().count("x"), sorted(set(results)))
        RATE = 3.0
        print("CHANGED", *f(), open(LOG).read().count("x"))
    """)
    assert _said(out, "SAME") == ["1", "[1.0]"], out
    assert _said(out, "CHANGED") == ["1.5", "1.5", "2"], out


def test_a_large_object_compared_as_the_same_object_is_warned_about(tmp_path):
    """An object compared by its pickled bytes that pickles larger than 8 KiB (an
    array.array of 40 KB) is compared as the same object only: said when shipping."""
    out = _run(tmp_path, ranks=2, body="""
        import array
        TABLE = array.array("d", range(5000))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            f = synk.function(lambda: TABLE[0], reduce=None)
            f()
        said = [str(w.message) for w in caught if "may miss a change" in str(w.message)]
        print("WARNED", len(said), "TABLE" in said[0], "identity" in said[0])
    """)
    assert _said(out, "WARNED") == ["1", "True", "True"], out


def test_a_capture_that_changes_at_every_call_is_warned_about(tmp_path):
    """Shipping again is correct but costs a round trip: when it happens at each of 10
    calls in a row, synk says what changes and what to do."""
    out = _run(tmp_path, ranks=2, body="""
        class Counter:
            def __init__(self):
                self.calls = 0
            def step(self):
                return self.calls
        counter = Counter()
        f = synk.function(counter.step, reduce=None)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i in range(15):
                counter.calls += 1
                assert f() == [counter.calls] * 2
        said = [str(w.message) for w in caught if "each of its last" in str(w.message)]
        print("WARNED", len(said), "bcast_inputs" in said[0], "self" in said[0])
    """)
    assert _said(out, "WARNED") == ["1", "True", "True"], out


def test_a_capture_too_large_to_check_cheaply_is_warned_about(tmp_path):
    """The check costs about 20 ns per reference: above 10,000 of them (a 20,000-item list)
    synk says so when it ships the function, and the check stays exact."""
    out = _run(tmp_path, ranks=2, body="""
        ITEMS = list(range(20_000))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            f = synk.function(lambda: ITEMS[12_345], reduce=None)
            f()
        said = [str(w.message) for w in caught if "references and values" in str(w.message)]
        ITEMS[12_345] = -1
        print("WARNED", len(said), "synk.data" in said[0], *f())
    """)
    assert _said(out, "WARNED") == ["1", "True", "-1", "-1"], out


def test_captures_on_simulated_gpu_ranks(tmp_path):
    """The same rule on GPU ranks (the CUDA simulator): a small array changed in place in a
    global list, and a device array captured by the function, changed on rank 0's device."""
    script = tmp_path / "script.py"
    out = run_script(script, textwrap.dedent("""
        import os
        os.environ["SYNK_SIMULATE_GPUS"] = "2"
        import numpy as np
        import synk
        from synk.simulator import cupy as cp
        synk.fork(2, backend="gpu")
        PARAMS = [np.arange(3.0)]
        f = synk.function(lambda: float(PARAMS[0].sum()), reduce=None)
        f()
        PARAMS[0][1] = 10.0
        print("HOST", *f(), float(PARAMS[0].sum()))
        with cp.cuda.Device(0):
            D = cp.arange(4.0)
        g = synk.function(lambda: float(D.sum().get()), reduce=None)
        g()
        D[0] = 100.0
        print("DEVICE", *g(), float(D.sum().get()))
        synk.close()
    """))
    assert _said(out, "HOST") == ["12.0"] * 3, out
    assert _said(out, "DEVICE") == ["106.0"] * 3, out


def test_what_the_function_changes_itself_stays_each_ranks_own(tmp_path):
    """A function that changes what it captures (a model's parameters, an optimizer's
    state, a counter) changes every rank's copy as it runs: that is not shipped again
    (each rank keeps its own), while a change made by the script between calls still is."""
    out = _run(tmp_path, ranks=2, body="""
        class Counter:
            pickled = 0
            def __init__(self):
                self.calls, self.ranks = 0, []
            def __getstate__(self):
                Counter.pickled += 1
                return self.__dict__
        counter = Counter()
        def count(x):
            counter.calls += 1
            counter.ranks.append(synk.comm.rank())
            return counter.calls, sum(counter.ranks)
        f = synk.function(count, reduce=None)
        for _ in range(4):
            calls, ranks = f(np.ones(4))
        print("OWN", Counter.pickled, *calls, *ranks)
        counter.calls = 100  # the script's change: shipped, on every rank
        calls, ranks = f(np.ones(4))
        print("SCRIPT", Counter.pickled, *calls, *ranks)
    """)
    assert _said(out, "OWN") == ["1", "4", "4", "0", "4"], out  # rank 1's own list: 1s
    # shipped again: every rank's counter is the script's (rank 0's list), then its own call
    assert _said(out, "SCRIPT") == ["2", "101", "101", "0", "1"], out
