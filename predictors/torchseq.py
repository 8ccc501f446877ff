"""``torch-seq``: a small GRU over each session's recent responses (CPU is enough).

Input: the feature rows of the session's last
:data:`~kvprefetch.predictors.features.SEQUENCE_LENGTH`
responses (the live tracker keeps exactly these; training builds the same windows from the
dataset), standardised, plus a validity flag. A GRU summarises them; an MLP over the summary
and the current row outputs three log-gap quantiles, parametrised as ``a, a + softplus(b),
a + softplus(b) + softplus(c)`` so they can never cross, and the logit of "returns within
``horizon_s``". Trained with pinball loss on the returned gaps plus binary cross-entropy,
with a fixed seed. The artifact stores the ``state_dict`` (``torch.save``, loaded with
``weights_only=True``: no pickle of code).

torch is imported only when this model is trained or loaded.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvprefetch.controlplane.base.errors import PredictorError
from kvprefetch.controlplane.base.types import FORECAST_LEVELS
from kvprefetch.predictors.features import N_FEATURES, SEQUENCE_LENGTH, GapDataset, SessionFeatures
from kvprefetch.predictors.learned import LearnedPredictor

HIDDEN = 32
EPOCHS = 12
BATCH = 512
LEARNING_RATE = 3e-3


def _torch() -> Any:
    try:
        import torch
    except ImportError as exc:  # translate the dependency error at the edge
        raise PredictorError(
            "predictor 'torch-seq' needs torch: pip install 'kvprefetch[ml]'"
        ) from exc
    return torch


def _build_net(torch: Any) -> Any:
    nn = torch.nn

    class SeqNet(nn.Module):  # type: ignore[name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.gru = nn.GRU(N_FEATURES + 1, HIDDEN, batch_first=True)
            self.head = nn.Sequential(
                nn.Linear(HIDDEN + N_FEATURES, 64), nn.ReLU(), nn.Linear(64, 4)
            )

        def forward(self, seq: Any, current: Any) -> tuple[Any, Any]:
            _, h = self.gru(seq)
            out = self.head(torch.cat([h[-1], current], dim=1))
            steps = torch.nn.functional.softplus(out[:, 1:3])
            u = torch.cumsum(torch.cat([out[:, :1], steps], dim=1), dim=1)
            return u, out[:, 3]

    return SeqNet()


class TorchSeqPredictor(LearnedPredictor):
    """GRU over recent responses with monotone quantile heads and a return head."""

    name = "torch-seq"
    payload_encoding = "torch"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.net: Any = None
        self.mean = np.zeros(N_FEATURES)
        self.scale: np.ndarray = np.ones(N_FEATURES)

    # -- inputs ---------------------------------------------------------------------------
    def _inputs(self, seq: np.ndarray, valid: np.ndarray) -> tuple[Any, Any]:
        torch = _torch()
        z = (seq - self.mean) / self.scale * valid[:, :, None]
        full = np.concatenate([z, valid[:, :, None].astype(np.float64)], axis=2)
        t_seq = torch.from_numpy(full.astype(np.float32))
        return t_seq, t_seq[:, -1, :N_FEATURES]

    def _run(self, seq: np.ndarray, valid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        torch = _torch()
        t_seq, current = self._inputs(seq, valid)
        self.net.eval()
        with torch.no_grad():
            u, logit = self.net(t_seq, current)
        return u.double().numpy(), torch.sigmoid(logit).double().numpy()

    def _predict_dataset(self, ds: GapDataset) -> tuple[np.ndarray, np.ndarray]:
        return self._run(*ds.windows(SEQUENCE_LENGTH))

    def _predict(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        # rows without history: each as a sequence of one response
        seq = np.zeros((len(x), SEQUENCE_LENGTH, N_FEATURES))
        seq[:, -1] = x
        valid = np.zeros((len(x), SEQUENCE_LENGTH), dtype=bool)
        valid[:, -1] = True
        return self._run(seq, valid)

    def _predict_states(self, states: Sequence[SessionFeatures]) -> tuple[np.ndarray, np.ndarray]:
        seq = np.zeros((len(states), SEQUENCE_LENGTH, N_FEATURES))
        valid = np.zeros((len(states), SEQUENCE_LENGTH), dtype=bool)
        for i, st in enumerate(states):
            hist = st.history
            if hist:
                seq[i, SEQUENCE_LENGTH - len(hist) :] = hist
                valid[i, SEQUENCE_LENGTH - len(hist) :] = True
        return self._run(seq, valid)

    # -- fitting --------------------------------------------------------------------------
    def _fit(self, ds: GapDataset, rng: np.random.Generator, progress: bool) -> None:
        torch = _torch()
        from tqdm.auto import tqdm

        seed = int(rng.integers(2**31 - 1))
        torch.manual_seed(seed)
        self.mean = ds.x.mean(axis=0)
        std = ds.x.std(axis=0)
        self.scale = np.where(std > 1e-9, std, 1.0)
        self.net = _build_net(torch)
        seq, valid = ds.windows(SEQUENCE_LENGTH)
        t_seq, t_cur = self._inputs(seq, valid)
        returned = torch.from_numpy(ds.returned)
        target = torch.from_numpy(np.log1p(np.where(ds.returned, ds.gap_s, 0.0)).astype(np.float32))
        label = torch.from_numpy((ds.gap_s <= self.horizon_s).astype(np.float32))
        levels = torch.tensor(FORECAST_LEVELS, dtype=torch.float32)
        opt = torch.optim.Adam(self.net.parameters(), lr=LEARNING_RATE)
        gen = torch.Generator().manual_seed(seed)
        bce = torch.nn.BCEWithLogitsLoss()
        n = len(ds)
        self.net.train()
        for _ in tqdm(range(EPOCHS), desc="torch-seq", disable=not progress):
            for idx in torch.randperm(n, generator=gen).split(BATCH):
                u, logit = self.net(t_seq[idx], t_cur[idx])
                r = returned[idx]
                diff = target[idx][:, None] - u
                pin = torch.maximum(levels * diff, (levels - 1) * diff).mean(dim=1)
                loss = bce(logit, label[idx])
                if bool(r.any()):
                    loss = loss + 2.0 * pin[r].mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
        self.net.eval()

    # -- artifacts ------------------------------------------------------------------------
    def _get_state(self) -> tuple[dict[str, Any], bytes]:
        torch = _torch()
        buf = io.BytesIO()
        torch.save(
            {"state_dict": self.net.state_dict(), "mean": torch.from_numpy(self.mean),
             "scale": torch.from_numpy(self.scale)},
            buf,
        )
        return {"hidden": HIDDEN, "sequence_length": SEQUENCE_LENGTH,
                "torch_version": torch.__version__}, buf.getvalue()

    def _set_state(self, params: dict[str, Any], payload: bytes) -> None:
        if params.get("hidden") != HIDDEN or params.get("sequence_length") != SEQUENCE_LENGTH:
            raise ValueError("network shape differs from this version's torch-seq model")
        torch = _torch()
        state = torch.load(io.BytesIO(payload), weights_only=True)
        self.net = _build_net(torch)
        self.net.load_state_dict(state["state_dict"])
        self.net.eval()
        self.mean = state["mean"].double().numpy()
        self.scale = state["scale"].double().numpy()
