"""The ``cluster`` job: hierarchical k-means over the embeddings, semantic dedup inside leaf clusters.

Clustering needs every embedding, so the first cluster worker that finds the embed queue drained
trains the model once (under an advisory lock): k-means (faiss, spherical) with ``levels[0]``
clusters over all embeddings, then ``levels[1]`` inside each of them, and so on (top-down, as the
report clusters for midtraining). In each leaf, images whose cosine similarity to a kept image of
the same leaf reaches ``semantic_threshold`` are semantic duplicates of it (the larger, then older
image is kept). The model (centroids + duplicate map) is a row of ``cluster_models``; then rows are
claimed as usual and get their cluster id per level (``cluster_ids``) and their semantic verdict.
Rows ingested after the model was trained are assigned to its clusters (no semantic dedup for them).
"""

from __future__ import annotations

import io
import json
from collections import defaultdict

import numpy as np

from .config import ClusterConfig
from .warehouse import Outcome, Warehouse

CLUSTER_LOCK = 0x6B72656132_03
"""Advisory lock key: one worker trains the cluster model."""


def load_embeddings(paths_rows: list[tuple[str, int]]) -> np.ndarray:
    """(N, dim) float32 rows from the embed job's .npy shards (each file read once)."""
    cache: dict[str, np.ndarray] = {}
    out = []
    for path, row in paths_rows:
        if path not in cache:
            cache[path] = np.load(path)
        out.append(cache[path][row])
    return np.stack(out).astype(np.float32)


def _kmeans(vectors: np.ndarray, k: int, config: ClusterConfig) -> np.ndarray:
    """(k', dim) unit centroids, k' = min(k, N)."""
    import faiss

    k = min(k, len(vectors))
    if k == 1:
        centroid = vectors.mean(0, keepdims=True)
        return centroid / max(np.linalg.norm(centroid), 1e-12)
    kmeans = faiss.Kmeans(vectors.shape[1], k, niter=config.iterations, seed=config.seed, spherical=True,
                          min_points_per_centroid=1, verbose=False)
    kmeans.train(np.ascontiguousarray(vectors))
    return kmeans.centroids


class ClusterModel:
    """Centroids of every node of the hierarchy: ``nodes[path]`` is (k, dim) for the children of
    ``path`` (a tuple of cluster ids from the root; ``()`` is the root)."""

    def __init__(self, nodes: dict[tuple, np.ndarray], levels: list[int]):
        self.nodes, self.levels = nodes, levels

    @classmethod
    def train(cls, vectors: np.ndarray, config: ClusterConfig) -> "ClusterModel":
        nodes: dict[tuple, np.ndarray] = {}
        frontier = {(): np.arange(len(vectors))}
        for k in config.levels:
            children: dict[tuple, np.ndarray] = {}
            for path, members in frontier.items():
                nodes[path] = _kmeans(vectors[members], k, config)
                labels = (vectors[members] @ nodes[path].T).argmax(1)
                for label in np.unique(labels):
                    children[path + (int(label),)] = members[labels == label]
            frontier = children
        return cls(nodes, list(config.levels))

    def assign(self, vectors: np.ndarray) -> list[tuple[int, ...]]:
        """The leaf path of each (N, dim) unit vector: nearest centroid at every level."""
        paths = []
        for vector in vectors:
            path: tuple = ()
            while path in self.nodes:
                path = path + (int((self.nodes[path] @ vector).argmax()),)
            paths.append(path)
        return paths

    def to_bytes(self) -> bytes:
        buffer = io.BytesIO()
        np.savez(buffer, **{"n" + "_".join(map(str, path)): c for path, c in self.nodes.items()})
        return buffer.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes, levels: list[int]) -> "ClusterModel":
        archive = np.load(io.BytesIO(data))
        nodes = {tuple(int(p) for p in key[1:].split("_") if p): archive[key] for key in archive.files}
        return cls(nodes, levels)


def semantic_duplicates(vectors: np.ndarray, leaves: list[tuple], order_key: list[tuple], threshold: float) -> dict[int, tuple[int, float]]:
    """Index -> (index of the kept image it duplicates, cosine) within each leaf; images are kept
    greedily in ``order_key`` order (larger, then older first)."""
    by_leaf: dict[tuple, list[int]] = defaultdict(list)
    for index, leaf in enumerate(leaves):
        by_leaf[leaf].append(index)
    duplicates = {}
    for members in by_leaf.values():
        members.sort(key=lambda i: order_key[i])
        kept: list[int] = []
        for index in members:
            if kept:
                sims = vectors[kept] @ vectors[index]
                best = int(sims.argmax())
                if sims[best] >= threshold:
                    duplicates[index] = (kept[best], float(sims[best]))
                    continue
            kept.append(index)
    return duplicates


class ClusterJob:
    def __init__(self, config: ClusterConfig):
        self.config = config
        self.model: ClusterModel | None = None
        self.duplicates: dict[int, tuple[int, float]] = {}

    def _load(self, conn) -> bool:
        row = conn.execute("SELECT centroids, levels, semantic_duplicates FROM cluster_models ORDER BY id DESC LIMIT 1").fetchone()
        if row is None:
            return False
        self.model = ClusterModel.from_bytes(bytes(row[0]), list(row[1]))
        self.duplicates = {int(k): (v[0], v[1]) for k, v in row[2].items()}
        return True

    def ready(self, warehouse: Warehouse) -> bool:
        """A model exists, or the embed queue is drained and this worker trained one."""
        conn = warehouse.conn
        if self.model is not None or self._load(conn):
            return True
        with conn.transaction():
            if conn.execute("SELECT EXISTS (SELECT 1 FROM images WHERE status = 'pending' OR "
                            "(status = 'kept' AND embed_done_at IS NULL))").fetchone()[0]:
                return False
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (CLUSTER_LOCK,))
            if self._load(conn):
                return True
            rows = conn.execute("SELECT id, embedding_path, embedding_row, width::bigint * height FROM images "
                                "WHERE status = 'kept' AND embed_done_at IS NOT NULL ORDER BY id").fetchall()
            if not rows:
                return False
            vectors = load_embeddings([(r[1], r[2]) for r in rows])
            model = ClusterModel.train(vectors, self.config)
            leaves = model.assign(vectors)
            found = semantic_duplicates(vectors, leaves, [(-r[3], r[0]) for r in rows], self.config.semantic_threshold)
            dup_map = {str(rows[i][0]): [rows[j][0], round(sim, 5)] for i, (j, sim) in found.items()}
            conn.execute("INSERT INTO cluster_models (levels, num_embeddings, centroids, semantic_duplicates) "
                         "VALUES (%s, %s, %s, %s)", (self.config.levels, len(rows), model.to_bytes(), json.dumps(dup_map)))
        return self._load(conn)

    def run(self, warehouse: Warehouse, rows: list[dict]) -> None:
        vectors = load_embeddings([(r["embedding_path"], r["embedding_row"]) for r in rows])
        outcomes = []
        for row, leaf in zip(rows, self.model.assign(vectors)):
            duplicate = self.duplicates.get(row["id"])
            values = {"cluster_ids": list(leaf), "semantic_duplicate_of": duplicate[0] if duplicate else None}
            outcomes.append(Outcome(row["id"], values, drop="semantic_duplicate" if duplicate else None,
                                    score=duplicate[1] if duplicate else None))
        warehouse.write("cluster", outcomes)
