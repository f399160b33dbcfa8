"""A PyTorch training loop (nn.Module + optimizer) made data-parallel with synk.

    python demos/train_torch.py [RANKS] [EPOCHS]

Part 1 is the loop as you may have it: an MLP of MNIST's sizes (784 -> 32 -> 10) trained
with cross-entropy and SGD with momentum, on mini-batches of 20 rows, in one process.
Part 2 runs the same loop on every rank, in a few more lines:

1. ``synk.shared(model)`` makes the model's parameters shared variables: every rank keeps a
   replica of each, and every rank's copy of the model (and of its optimizer, which go
   with the step function) computes on that rank's replicas; the optimizer's steps update
   them in place;
2. the data becomes ``synk.data`` (shared memory, split by rows; torch tensors in, torch
   tensors inside the function);
3. the step is wrapped with ``synk.function``; after ``loss.backward()``,
   ``synk.comm.allreduce(grads, "mean", weight=len(x), out=grads)`` averages the gradients
   over the ranks, weighted by their rows, in place, and every rank's optimizer takes the
   same step (for a large model, ``with synk.comm.average_gradients(model, weight=len(x)):``
   around the backward pass averages them in buckets while backward runs, as DDP does);
4. the loop passes ``batch=idx`` instead of slicing the mini-batch itself.

Both parts see the same mini-batches; the demo prints each epoch's mean loss from both and
checks that they agree to float32's tolerance.
"""
import copy
import sys

import numpy as np
import torch
import torch.nn.functional as F

import synk

N_SAMPLES, FEATURES, HIDDEN, CLASSES = 2000, 784, 32, 10
BATCH, LR, MOMENTUM = 20, 0.05, 0.9


def make_data(seed=0):
    """MNIST-sized random images and labels that depend on them (no download needed)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((N_SAMPLES, FEATURES)).astype(np.float32)
    y = (x[:, :CLASSES] * 3 + rng.standard_normal((N_SAMPLES, CLASSES))).argmax(axis=1)
    return torch.from_numpy(x), torch.from_numpy(y)


def make_model(seed=1):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.ReLU(),
                               torch.nn.Linear(HIDDEN, CLASSES))


def minibatches(epoch):
    order = np.random.default_rng(100 + epoch).permutation(N_SAMPLES)
    return [order[i:i + BATCH] for i in range(0, N_SAMPLES, BATCH)]


# -- Part 1: the loop as you have it ---------------------------------------------------------
def train_alone(model, opt, x, y, epochs):
    losses = []
    for epoch in range(epochs):
        total = []
        for idx in minibatches(epoch):
            opt.zero_grad()
            loss = F.cross_entropy(model(x[idx]), y[idx])
            loss.backward()
            opt.step()
            total.append(loss.item())
        losses.append(np.mean(total))
    return losses


# -- Part 2: the same loop on every rank -----------------------------------------------------
def data_parallel_step(model, opt):
    """The step, for every rank: its rows of the mini-batch, the gradients averaged over the
    ranks, the optimizer's step (``model``'s parameters: this rank's replicas)."""

    def step(x, y):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        grads = [p.grad for p in model.parameters()]
        synk.comm.allreduce(grads, "mean", weight=len(x), out=grads)  # over every rank
        opt.step()
        return loss

    return step


def train_synk(model, opt, x, y, epochs):
    synk.shared(model)  # its parameters: a replica on every rank
    x_data, y_data = synk.data(x), synk.data(y)  # shared memory, split by rows
    step = synk.function(data_parallel_step(model, opt), inputs=["x", "y"])
    losses = []
    for epoch in range(epochs):
        total = [step(x_data, y_data, batch=idx).item() for idx in minibatches(epoch)]
        losses.append(np.mean(total))
    return losses


def main():
    ranks = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    epochs = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    x, y = make_data()
    model = make_model()
    alone = copy.deepcopy(model)
    alone_losses = train_alone(alone, torch.optim.SGD(alone.parameters(), lr=LR,
                                                      momentum=MOMENTUM), x, y, epochs)
    synk.fork(ranks)
    try:
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        losses = train_synk(model, opt, x, y, epochs)
        for epoch, (mine, theirs) in enumerate(zip(losses, alone_losses)):
            print(f"epoch {epoch}: loss {mine:.6f} with synk on {ranks} ranks, "
                  f"{theirs:.6f} in one process")
        every_rank = synk.shared_gather(model, concat=False)  # [parameter][rank]
        gap = max(float(np.abs(np.asarray(mine) - q.detach().numpy()).max())
                  for ranks_values, q in zip(every_rank, alone.parameters())
                  for mine in ranks_values)
    finally:
        synk.close()
    assert np.allclose(losses, alone_losses, rtol=1e-5, atol=1e-6), (losses, alone_losses)
    assert gap < 1e-4, f"the replicas differ from the one-process model by {gap:.1e}"
    print(f"synk's losses match the single-process ones on {ranks} ranks "
          f"(parameters within {gap:.1e}).")
    print("All assertions passed.")


main()
