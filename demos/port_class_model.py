"""Porting a class-based numpy model to synk.

    python demos/port_class_model.py [RANKS]

Part 1 is a model as it is often written (in the style of Michael Nielsen's ``network.py``):
a ``Network`` class holding its parameters as lists of arrays, with methods for backprop and
for one mini-batch step, trained by SGD over shuffled mini-batches.

Part 2 ports it to synk the way synk wants it:

1. the parameters become ``synk.shared`` variables, one per array: every rank keeps a replica
   and the step updates it in place;
2. the step becomes a module-level function of the mini-batch rows and the parameters (not
   the bound method ``net.update_mini_batch``: its ``self`` is shipped to the workers, but
   what the step changes in ``self`` stays on each rank, so every rank's copy of ``net``
   would take only the gradients of its own rows, and the copies would drift apart);
3. the gradients of each rank's rows are averaged over the ranks by
   ``synk.comm.allreduce(grads, "mean", weight=len(x))``, and every rank applies the same
   update;
4. the loop passes each shuffled mini-batch as ``batch=`` indices into the data set, which
   sits in shared memory once (``synk.data``).

Both parts start from the same parameters and see the same mini-batches, so they end with
the same parameters up to float rounding: the demo checks every rank's replicas against the
class's to 1e-12 and exits non-zero if they differ. docs/training.md ("Porting a
class-based model") shows the code between the ``# --`` lines below, verbatim.
"""
import sys

import numpy as np

import synk

# -- Part 1: the model you have ----------------------------------------------------------------
SIZES, ETA, BATCH, EPOCHS = [8, 16, 3], 3.0, 32, 5

rng = np.random.default_rng(0)                     # 300 rows, 8 features, 3 classes
x_train = rng.normal(size=(300, 8))
y_train = np.eye(3)[np.argmax(x_train @ rng.normal(size=(8, 3)), axis=1)]


def sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


class Network:
    def __init__(self, sizes, seed=0):
        rng = np.random.default_rng(seed)
        self.sizes = sizes
        self.biases = [rng.normal(size=n) for n in sizes[1:]]
        self.weights = [rng.normal(size=(n, m)) for m, n in zip(sizes[:-1], sizes[1:])]

    def feedforward(self, x):
        for b, w in zip(self.biases, self.weights):
            x = sigmoid(x @ w.T + b)
        return x

    def backprop(self, x, y):
        """Gradients of the quadratic cost, summed over the rows of x."""
        activations = [x]
        for b, w in zip(self.biases, self.weights):
            activations.append(sigmoid(activations[-1] @ w.T + b))
        a = activations[-1]
        delta = (a - y) * a * (1.0 - a)
        nabla_b, nabla_w = [], []
        for w, a_in in zip(reversed(self.weights), reversed(activations[:-1])):
            nabla_b.insert(0, delta.sum(axis=0))
            nabla_w.insert(0, delta.T @ a_in)
            delta = (delta @ w) * a_in * (1.0 - a_in)
        return nabla_b, nabla_w

    def update_mini_batch(self, mini_batch, eta):
        x, y = mini_batch
        nabla_b, nabla_w = self.backprop(x, y)
        for p, g in zip(self.biases + self.weights, nabla_b + nabla_w):
            p -= eta * g / len(x)                  # the mean gradient over the mini-batch

    def sgd(self, x, y, epochs, batch_size, eta, seed=1):
        rng = np.random.default_rng(seed)
        for _ in range(epochs):
            order = rng.permutation(len(x))
            for k in range(0, len(x), batch_size):
                idx = order[k:k + batch_size]
                self.update_mini_batch((x[idx], y[idx]), eta)


net = Network(SIZES)
net.sgd(x_train, y_train, EPOCHS, BATCH, ETA)
# -- end of part 1 -----------------------------------------------------------------------------

# One rank per CPU core (one per GPU with the GPU backend), or as many as the first argument.
n = synk.fork(int(sys.argv[1]) if len(sys.argv) > 1 else None)
print(f"synk: {n} ranks")


# -- Part 2: the synk port ---------------------------------------------------------------------
def backprop(x, y, biases, weights):
    """Network.backprop as a function of the parameters, with xp for np; also the cost."""
    xp = synk.xp(x)                                # numpy here, cupy on GPU ranks
    activations = [x]
    for b, w in zip(biases, weights):
        activations.append(1.0 / (1.0 + xp.exp(-(activations[-1] @ w.T + b))))
    a = activations[-1]
    delta = (a - y) * a * (1.0 - a)
    nabla_b, nabla_w = [], []
    for w, a_in in zip(reversed(weights), reversed(activations[:-1])):
        nabla_b.insert(0, delta.sum(axis=0))
        nabla_w.insert(0, delta.T @ a_in)
        delta = (delta @ w) * a_in * (1.0 - a_in)
    return 0.5 * ((a - y) ** 2).sum(), nabla_b, nabla_w


def sgd_step(x, y, eta, *params):
    """Network.update_mini_batch on this rank's rows of the mini-batch. params: this rank's
    replicas of the biases, then of the weights, updated in place."""
    layers = len(params) // 2
    cost, nabla_b, nabla_w = backprop(x, y, params[:layers], params[layers:])
    rows = max(len(x), 1)                          # a rank may get no rows (its weight is 0)
    grads = [g / rows for g in nabla_b + nabla_w]  # the mean over this rank's rows ...
    grads = synk.comm.allreduce(grads, "mean", weight=len(x))  # ... over the mini-batch's
    for p, g in zip(params, grads):
        p -= eta * g                               # in place: the replica keeps it
    return cost / rows                             # reduce="mean": the mini-batch's mean cost


start = Network(SIZES)                             # the same initial parameters as net's
params = [synk.shared(p) for p in start.biases + start.weights]
x_data, y_data = synk.data(x_train), synk.data(y_train)
step = synk.function(sgd_step, inputs=["x", "y"], reduce="mean")

rng = np.random.default_rng(1)                     # the same shuffles as Network.sgd
for epoch in range(EPOCHS):
    order = rng.permutation(len(x_train))
    costs = [step(x_data, y_data, ETA, *params, batch=order[k:k + BATCH])
             for k in range(0, len(x_train), BATCH)]
    print(f"epoch {epoch}: mean cost {np.mean(costs):.4f}")
# -- end of part 2 -----------------------------------------------------------------------------

# -- The check ---------------------------------------------------------------------------------
gap = max(float(np.abs(p.get_value(r) - q).max())
          for p, q in zip(params, net.biases + net.weights) for r in range(synk.size()))
assert gap < 1e-12, f"synk differs from the class-based model by {gap:.1e}"
print(f"synk matches the class-based model: max difference {gap:.1e} on {synk.size()} ranks")
# -- end of the check --------------------------------------------------------------------------

synk.close()
