"""A real, tiny, offline classification task: scikit-learn's 8x8 digits and a CNN trained on it.

End-to-end tests need a model whose *accuracy* (not just SQNR) can be checked after quantization,
on data that ships inside a pip package (no download) and trains to >= 95% in seconds on 2 CPU
cores. The CNN uses only quantization-friendly ops: conv-bn-relu, a residual add followed by a
ReLU, max-pool, flatten and Linear.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from qplug_core.errors import QplugError
from qplug_core.zoo._rng import seeded

__all__ = ["DigitsCNN", "accuracy", "digits_cnn", "load_digits_tensors", "train_digits_cnn"]

#: fraction of the 1797 images held out for testing (stratified, fixed seed)
TEST_FRACTION = 0.25
_SPLIT_SEED = 0


def load_digits_tensors() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x_train, y_train, x_test, y_test)``: images ``[N, 1, 8, 8]`` float32, labels int64.

    The split is fixed and stratified; pixels are standardised with the *training* mean and std,
    so the same call always returns the same tensors.
    """
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError as e:
        raise QplugError(
            "the digits dataset needs scikit-learn: pip install scikit-learn") from e
    data = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        data.images, data.target, test_size=TEST_FRACTION, random_state=_SPLIT_SEED,
        stratify=data.target)
    x_train, x_test = (torch.tensor(x, dtype=torch.float32).unsqueeze(1) for x in (x_train, x_test))
    mean, std = x_train.mean(), x_train.std()
    return ((x_train - mean) / std, torch.tensor(y_train, dtype=torch.int64),
            (x_test - mean) / std, torch.tensor(y_test, dtype=torch.int64))


class DigitsCNN(nn.Module):
    """conv-bn-relu, conv-bn(+skip)-relu at 8x8, max-pool, conv-bn-relu at 4x4, flatten, Linear."""

    def __init__(self, width: int = 16, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.relu2 = nn.ReLU()
        self.pool = nn.MaxPool2d(2)
        self.conv3 = nn.Conv2d(width, 2 * width, 3, padding=1, bias=False)
        self.bn3 = nn.BatchNorm2d(2 * width)
        self.relu3 = nn.ReLU()
        self.fc = nn.Linear(2 * width * 4 * 4, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = self.relu1(self.bn1(self.conv1(x)))
        x = self.relu2(self.bn2(self.conv2(identity)) + identity)
        x = self.relu3(self.bn3(self.conv3(self.pool(x))))
        return self.fc(torch.flatten(x, 1))


def digits_cnn(width: int = 16, num_classes: int = 10) -> DigitsCNN:
    """An untrained :class:`DigitsCNN` (use :func:`train_digits_cnn` for a trained one)."""
    return DigitsCNN(width, num_classes)


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 512) -> float:
    """Top-1 accuracy of ``model`` in eval mode; the model's train/eval mode is restored after."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        correct = sum(int((model(x[i:i + batch_size]).argmax(1) == y[i:i + batch_size]).sum())
                      for i in range(0, len(x), batch_size))
    finally:
        for m, training in modes:
            m.training = training
    return correct / len(x)


@contextlib.contextmanager
def _reproducible() -> Iterator[None]:
    """Deterministic kernels on one thread, then the caller's settings back.

    One thread makes the trained weights independent of the machine's core count, and on a busy
    2-core box it is also ~10x faster for a model this small than contended multi-threading.
    """
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)


def train_digits_cnn(epochs: int = 8, seed: int = 0, batch_size: int = 32,
                     lr: float = 3e-3) -> tuple[DigitsCNN, float]:
    """Train a :class:`DigitsCNN` deterministically; returns ``(eval-mode model, test accuracy)``.

    Initialisation and shuffling draw from ``seed`` only (the caller's global RNG is untouched)
    and training runs single-threaded with deterministic kernels, so two calls with the same
    arguments give identical weights.
    """
    x_train, y_train, x_test, y_test = load_digits_tensors()
    with _reproducible(), seeded(seed):
        model = digits_cnn()
        shuffle = torch.Generator().manual_seed(seed)
        optimizer = torch.optim.Adam(model.parameters(), lr=lr)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=lr, total_steps=epochs * -(-len(x_train) // batch_size))
        model.train()
        for _ in range(epochs):
            for idx in torch.randperm(len(x_train), generator=shuffle).split(batch_size):
                optimizer.zero_grad()
                nn.functional.cross_entropy(model(x_train[idx]), y_train[idx]).backward()
                optimizer.step()
                scheduler.step()
    model.eval()
    return model, accuracy(model, x_test, y_test)
