"""A JAX training loop (jax.grad and a plain update) made data-parallel with synk.

    python demos/train_jax.py [RANKS] [EPOCHS]

Part 1 is the loop as you may have it: an MLP of MNIST's sizes (784 -> 32 -> 10),
cross-entropy, ``jax.jit(jax.value_and_grad(loss))`` and plain SGD, on mini-batches of 20
rows, in one process. Part 2 runs it on every rank:

1. the parameters become ``synk.shared`` variables (a replica on every rank, a JAX array
   inside the function);
2. the data becomes ``synk.data`` (shared memory, split by rows);
3. the step is wrapped with ``synk.function``: each rank takes the gradient of its rows,
   ``synk.comm.allreduce(grads, "mean", weight=len(x))`` averages them over the ranks
   (inside ``jax.jit`` too), and ``synk.assign`` stores each rank's new parameters in its
   replicas (JAX arrays do not change in place);
4. the loop passes ``batch=idx`` instead of slicing the mini-batch itself.

Both parts see the same mini-batches; the demo prints each epoch's mean loss from both and
checks that they agree to float32's tolerance.
"""
import sys

import jax
import jax.numpy as jnp
import numpy as np

import synk

# float32 products in float32 on GPUs too (JAX's default there is TF32, whose rounding would
# hide the agreement checked below); synk gives the master's setting to every rank
jax.config.update("jax_default_matmul_precision", "highest")

N_SAMPLES, FEATURES, HIDDEN, CLASSES = 2000, 784, 32, 10
BATCH, LR = 20, 0.1


def make_data(seed=0):
    """MNIST-sized random images and labels that depend on them (no download needed)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((N_SAMPLES, FEATURES)).astype(np.float32)
    y = (x[:, :CLASSES] * 3 + rng.standard_normal((N_SAMPLES, CLASSES))).argmax(axis=1)
    return jnp.asarray(x), jnp.asarray(y)


def init_params(seed=1):
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    return [jax.random.normal(k1, (FEATURES, HIDDEN)) * 0.05, jnp.zeros(HIDDEN),
            jax.random.normal(k2, (HIDDEN, CLASSES)) * 0.05, jnp.zeros(CLASSES)]


def loss_fn(params, x, y):
    w1, b1, w2, b2 = params
    logits = jnp.maximum(x @ w1 + b1, 0.0) @ w2 + b2
    return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(len(y)), y])


grad_fn = jax.jit(jax.value_and_grad(loss_fn))


def minibatches(epoch):
    order = np.random.default_rng(100 + epoch).permutation(N_SAMPLES)
    return [order[i:i + BATCH] for i in range(0, N_SAMPLES, BATCH)]


# -- Part 1: the loop as you have it ---------------------------------------------------------
def train_alone(params, x, y, epochs):
    losses = []
    for epoch in range(epochs):
        total = []
        for idx in minibatches(epoch):
            loss, grads = grad_fn(params, x[idx], y[idx])
            params = [p - LR * g for p, g in zip(params, grads)]
            total.append(float(loss))
        losses.append(np.mean(total))
    return losses, params


# -- Part 2: the same loop on every rank -----------------------------------------------------
@jax.jit
def sgd_update(params, x, y):
    """The gradients of this rank's rows, averaged over every rank, and the new values."""
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    grads = synk.comm.allreduce(grads, "mean", weight=len(x))  # (inside jit: a callback)
    return loss, [p - LR * g for p, g in zip(params, grads)]


def step(x, y, *params):
    """Run on every rank, on its rows of the mini-batch: the update, stored in its
    replicas (JAX arrays do not change in place)."""
    loss, new = sgd_update(list(params), x, y)
    for p, value in zip(params, new):
        synk.assign(p, value)  # this rank's replica keeps the new value
    return loss


def train_synk(params, x, y, epochs):
    shared = [synk.shared(p) for p in params]  # a replica on every rank
    x_data, y_data = synk.data(x), synk.data(y)  # shared memory, split by rows
    f = synk.function(step, inputs=["x", "y"])
    losses = []
    for epoch in range(epochs):
        total = [float(f(x_data, y_data, *shared, batch=idx)) for idx in minibatches(epoch)]
        losses.append(np.mean(total))
    return losses, shared


def main():
    ranks = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    epochs = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    x, y = make_data()
    params = init_params()
    alone_losses, alone = train_alone(params, x, y, epochs)
    synk.fork(ranks)
    try:
        losses, shared = train_synk(params, x, y, epochs)
        for epoch, (mine, theirs) in enumerate(zip(losses, alone_losses)):
            print(f"epoch {epoch}: loss {mine:.6f} with synk on {ranks} ranks, "
                  f"{theirs:.6f} in one process")
        gap = max(float(jnp.abs(s.get_value(r) - p).max())
                  for s, p in zip(shared, alone) for r in range(synk.size()))
    finally:
        synk.close()
    assert np.allclose(losses, alone_losses, rtol=1e-5, atol=1e-6), (losses, alone_losses)
    assert gap < 1e-4, f"the replicas differ from the one-process parameters by {gap:.1e}"
    print(f"synk's losses match the single-process ones on {ranks} ranks "
          f"(parameters within {gap:.1e}).")
    print("All assertions passed.")


main()
