"""minGPT (``synk.bench.gpt``, the model of pytorch/examples' minGPT-ddp, here a small
configuration without dropout) trained through synk as that example's trainer is written:
``synk.shared(model)``, the gradients averaged after backward or during it, their norm
clipped, AdamW; the losses and the parameters against the same steps in one process on the
whole mini-batches, in float32 and under AMP (bfloat16 autocast)."""
import numpy as np
import pytest

import synk

torch = pytest.importorskip("torch", reason="the torch tests need torch: pip install 'synk[torch]'")
pytestmark = [pytest.mark.frameworks, pytest.mark.timeout(300)]

STEPS, ROWS = 3, 6  # mini-batches of 6 sequences: 3 a rank on 2 ranks, 2 on 3


def _config():
    from synk.bench import gpt

    return gpt.GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=16,
                         dropout=0.0)


def _minibatches():
    return [np.arange(i * ROWS, (i + 1) * ROWS) for i in range(STEPS)]


def _alone(amp):
    from synk.bench import gpt

    model, opt = gpt.make_model(config=_config())
    x, y = gpt.tokens(STEPS * ROWS, _config())
    losses = []
    for idx in _minibatches():
        opt.zero_grad(set_to_none=True)
        loss = gpt.forward_loss(model, x[idx], y[idx], amp)
        loss.backward()
        gpt.update(model, opt)
        losses.append(loss.item())
    return losses, model


def _with_synk(size, amp, overlap):
    from synk.bench import gpt

    model, opt = gpt.make_model(config=_config())
    x, y = gpt.tokens(STEPS * ROWS, _config())

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        if overlap:
            with synk.comm.average_gradients(model, weight=len(x)):
                loss = gpt.forward_loss(model, x, y, amp)
                loss.backward()
        else:
            loss = gpt.forward_loss(model, x, y, amp)
            loss.backward()
            grads = [p.grad for p in model.parameters()]
            synk.comm.allreduce(grads, "mean", weight=len(x), out=grads)
        gpt.update(model, opt)
        return loss

    synk.fork(size)
    try:
        synk.shared(model)
        train = synk.function(step, inputs=["x", "y"])
        xd, yd = synk.data(x), synk.data(y)
        losses = [float(train(xd, yd, batch=idx)) for idx in _minibatches()]
        every_rank = synk.shared_gather(model, concat=False)  # [parameter][rank]
    finally:
        synk.close()
    return losses, every_rank


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("overlap", [False, True], ids=["after-backward", "during-backward"])
@pytest.mark.parametrize("amp", [False, True], ids=["float32", "amp"])
def test_mingpt_trained_through_synk_is_the_one_process_model(size, overlap, amp):
    # bfloat16 keeps 8 bits of mantissa: under AMP each rank's products round differently
    # from the whole mini-batch's
    tol = dict(rtol=2e-2, atol=2e-3) if amp else dict(rtol=1e-5, atol=1e-6)
    want_losses, alone = _alone(amp)
    losses, every_rank = _with_synk(size, amp, overlap)
    np.testing.assert_allclose(losses, want_losses, **tol)
    for name, p, replicas in zip(dict(alone.named_parameters()), alone.parameters(),
                                 every_rank):
        assert len(replicas) == size
        for r, replica in enumerate(replicas):
            np.testing.assert_allclose(np.asarray(replica), p.detach().numpy(), **tol,
                                       err_msg=f"{name} on rank {r}")
        for replica in replicas[1:]:  # the ranks took the same steps
            np.testing.assert_array_equal(np.asarray(replica), np.asarray(replicas[0]))
