"""LeRobot datasets (format v3.0) written and read with pyarrow, OpenCV and PyAV, without LeRobot.

Layout of a dataset folder (LeRobot's ``LeRobotDataset(repo_id, root=folder)`` reads it)::

    meta/info.json                          codebase_version "v3.0", fps, features (dtype, shape,
                                            names), totals, chunks/files sizes, path templates
    meta/stats.json                         per feature: min, max, mean, std, count, q01 ... q99
    meta/tasks.parquet                      task string (index) -> task_index
    meta/episodes/chunk-000/file-000.parquet  one row per episode: episode_index, tasks, length,
                                            data/{chunk,file}_index, dataset_{from,to}_index,
                                            videos/<key>/{chunk_index, file_index, from_timestamp,
                                            to_timestamp}, stats/<feature>/<stat>,
                                            meta/episodes/{chunk,file}_index (+ extra columns)
    data/chunk-000/file-000.parquet         one row per frame: the features, timestamp,
                                            frame_index, episode_index, index, task_index
    videos/<key>/chunk-000/file-000.mp4     every episode's frames of one camera, one after the
                                            other (frame t of an episode at from_timestamp + t/fps)

Row t of an episode is the observation the action of row t was taken in; ``next.*`` features
are what followed the action. `DatasetWriter` writes every episode into one data file and one
video file per camera (mp4v, lossy); `DatasetReader` follows the per-episode chunk and file
indices, so it also reads datasets that LeRobot's own writer split over several files, and
decodes their videos with PyAV (FFmpeg with dav1d: AV1, LeRobot's default codec, as well as
H.264 and mp4v), the decoder LeRobot itself falls back to. Every problem with a dataset on disk
is a `DataError` naming the file and what to do.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import cv2
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import DataError

CODEBASE_VERSION = "v3.0"
CHUNK = "chunk-{chunk_index:03d}/file-{file_index:03d}"
DATA_PATH = "data/" + CHUNK + ".parquet"
VIDEO_PATH = "videos/{video_key}/" + CHUNK + ".mp4"
EPISODES_PATH = "meta/episodes/" + CHUNK + ".parquet"
INFO_PATH, STATS_PATH, TASKS_PATH = "meta/info.json", "meta/stats.json", "meta/tasks.parquet"
CHUNKS_SIZE, DATA_FILES_MB, VIDEO_FILES_MB = 1000, 100, 200
"""LeRobot's defaults: files per chunk folder, target sizes of data and video files"""
QUANTILES = (0.01, 0.10, 0.50, 0.90, 0.99)
STAT_FRAMES = 100
"""video statistics are computed over at most this many evenly spaced frames per episode"""
INDEX_FEATURES = {
    "timestamp": "float32", "frame_index": "int64", "episode_index": "int64", "index": "int64",
    "task_index": "int64",
}  # fmt: skip
"""the bookkeeping columns of every frame (shape [1] each)"""
ARROW = {"float32": pa.float32(), "float64": pa.float64(), "int64": pa.int64(),
         "int32": pa.int32(), "bool": pa.bool_()}  # fmt: skip


# ---------------------------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------------------------


class DatasetWriter:
    """Writes episodes into a new LeRobot v3.0 dataset folder; `finalize` writes the metadata.

    Args:
        root: the dataset folder (created; it must not hold a dataset already).
        fps: frames per second of the episodes (the env's control rate).
        features: name -> ``{"dtype", "shape", "names"}`` of the caller's features: camera
            streams have dtype ``video`` and shape (H, W, 3), the others a numeric dtype and
            shape (1,) or (n,). The bookkeeping columns (`INDEX_FEATURES`) are added here.
        robot_type: written to ``info.json``.
    """

    def __init__(self, root: str | Path, fps: int, features: dict, robot_type: str | None = None):
        self.root = Path(root)
        if (self.root / INFO_PATH).exists():
            raise DataError(f"{self.root} already holds a dataset; give a new folder")
        bad = [k for k in features if "/" in k or k in INDEX_FEATURES]
        if bad:
            raise ValueError(f"feature names {bad}: no '/' and none of {list(INDEX_FEATURES)}")
        self.fps, self.robot_type = int(fps), robot_type
        self.features = {k: {**v, "shape": list(v["shape"])} for k, v in features.items()}
        self.video_keys = [k for k, v in features.items() if v["dtype"] == "video"]
        self.tasks: dict[str, int] = {}
        self.episodes: list[dict] = []
        self.stats: list[dict] = []
        self.frames = 0
        self._data: pq.ParquetWriter | None = None
        self._videos: dict[str, cv2.VideoWriter] = {}

    def add_episode(self, columns: dict[str, np.ndarray], task: str, **extra) -> int:
        """Append one episode: ``columns`` has every feature as an array [T, ...] (videos
        [T, H, W, 3] uint8 RGB); ``extra`` are more columns of its episodes-metadata row (e.g.
        ``seed``). Returns its episode index."""
        T = len(columns[next(iter(self.features))])
        wrong = {k: len(columns[k]) for k in self.features if len(columns.get(k, ())) != T}
        if T == 0 or wrong:
            raise ValueError(f"episode of {T} frames; features with other lengths: {wrong}")
        for key in self.video_keys:  # a frame of another size would be dropped by the encoder
            if tuple(columns[key].shape[1:]) != tuple(self.features[key]["shape"]):
                raise ValueError(f"{key}: frames {columns[key].shape[1:]}, the feature's shape "
                                 f"is {self.features[key]['shape']}")  # fmt: skip
        e = len(self.episodes)
        tid = self.tasks.setdefault(task, len(self.tasks))
        index = {"timestamp": np.arange(T, dtype=np.float32) / self.fps,
                 "frame_index": np.arange(T), "episode_index": np.full(T, e),
                 "index": self.frames + np.arange(T), "task_index": np.full(T, tid)}  # fmt: skip
        table = self._table({**columns, **index})
        if self._data is None:
            path = self.root / DATA_PATH.format(chunk_index=0, file_index=0)
            path.parent.mkdir(parents=True, exist_ok=True)
            self._data = pq.ParquetWriter(path, table.schema, compression="snappy")
        self._data.write_table(table)
        row = {"episode_index": e, "tasks": [task], "length": T, "data/chunk_index": 0,
               "data/file_index": 0, "dataset_from_index": self.frames,
               "dataset_to_index": self.frames + T}  # fmt: skip
        start = self.frames / self.fps  # the episode's place in every camera's video file
        for key in self.video_keys:
            self._write_frames(key, columns[key])
            row.update({f"videos/{key}/chunk_index": 0, f"videos/{key}/file_index": 0,
                        f"videos/{key}/from_timestamp": start,
                        f"videos/{key}/to_timestamp": start + T / self.fps})  # fmt: skip
        stats = {k: episode_stats(v, self._dtype(k)) for k, v in {**columns, **index}.items()
                 if k in self.features or k in INDEX_FEATURES}  # fmt: skip
        for name, st in stats.items():
            row.update({f"stats/{name}/{s}": v.tolist() for s, v in st.items()})
        row.update({"meta/episodes/chunk_index": 0, "meta/episodes/file_index": 0, **extra})
        self.episodes.append(row)
        self.stats.append(stats)
        self.frames += T
        return e

    def _dtype(self, key: str) -> str:
        return INDEX_FEATURES.get(key) or self.features[key]["dtype"]

    def _table(self, columns: dict) -> pa.Table:
        """The frames' rows: (1,) features as scalars, (n,) as fixed-size lists (as LeRobot)."""
        out = {}
        for key in [*self.features, *INDEX_FEATURES]:
            if key in self.video_keys:
                continue
            kind = ARROW[self._dtype(key)]
            shape = self.features[key]["shape"] if key in self.features else [1]
            x = np.asarray(columns[key])
            if list(shape) == [1]:
                out[key] = pa.array(x.reshape(len(x)), kind)
            else:
                flat = pa.array(x.reshape(-1), kind)
                out[key] = pa.FixedSizeListArray.from_arrays(flat, int(np.prod(shape)))
        return pa.table(out)

    def _write_frames(self, key: str, frames: np.ndarray) -> None:
        h, w = frames.shape[1:3]
        if key not in self._videos:
            path = self.root / VIDEO_PATH.format(video_key=key, chunk_index=0, file_index=0)
            path.parent.mkdir(parents=True, exist_ok=True)
            writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), self.fps, (w, h))
            if not writer.isOpened():
                raise RuntimeError(f"OpenCV could not open a mp4v writer for {path}")
            self._videos[key] = writer
        for frame in frames:
            self._videos[key].write(cv2.cvtColor(np.ascontiguousarray(frame), cv2.COLOR_RGB2BGR))

    def finalize(self) -> dict:
        """Close the data and video files, write the metadata; returns ``info.json``'s content."""
        if not self.episodes:
            raise ValueError("a dataset needs at least one episode")
        self._data.close()
        for writer in self._videos.values():
            writer.release()
        meta = self.root / "meta"
        path = self.root / EPISODES_PATH.format(chunk_index=0, file_index=0)
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(self.episodes), path)
        write_tasks(meta / "tasks.parquet", list(self.tasks))
        stats = {k: aggregate_stats([s[k] for s in self.stats]) for k in self.stats[0]}
        (meta / "stats.json").write_text(
            json.dumps({k: {s: v.tolist() for s, v in st.items()} for k, st in stats.items()})
        )
        features = {k: dict(v) for k, v in self.features.items()}
        for key in self.video_keys:
            h, w, c = features[key]["shape"]
            features[key]["info"] = {
                "video.height": h, "video.width": w, "video.codec": "mpeg4",
                "video.pix_fmt": "yuv420p", "video.is_depth_map": False, "video.fps": self.fps,
                "video.channels": c, "has_audio": False,
            }  # fmt: skip
        for key, dtype in INDEX_FEATURES.items():
            features[key] = {"dtype": dtype, "shape": [1], "names": None}
        n = len(self.episodes)
        info = {
            "codebase_version": CODEBASE_VERSION, "robot_type": self.robot_type,
            "total_episodes": n, "total_frames": self.frames, "total_tasks": len(self.tasks),
            "chunks_size": CHUNKS_SIZE, "data_files_size_in_mb": DATA_FILES_MB,
            "video_files_size_in_mb": VIDEO_FILES_MB, "fps": self.fps,
            "splits": {"train": f"0:{n}"}, "data_path": DATA_PATH,
            "video_path": VIDEO_PATH if self.video_keys else None, "features": features,
        }  # fmt: skip
        (meta / "info.json").write_text(json.dumps(info, indent=4))
        return info


def write_tasks(path: Path, tasks: list[str]) -> None:
    """``meta/tasks.parquet``: the task strings as the table's (pandas) index named ``task``, and
    ``task_index``; the pandas metadata is written by hand, so that pandas (which LeRobot reads
    it with) restores the index without this package needing pandas."""
    pandas_meta = {
        "index_columns": ["task"],
        "column_indexes": [{"name": None, "field_name": None, "pandas_type": "unicode",
                            "numpy_type": "object", "metadata": {"encoding": "UTF-8"}}],
        "columns": [
            {"name": "task_index", "field_name": "task_index", "pandas_type": "int64",
             "numpy_type": "int64", "metadata": None},
            {"name": "task", "field_name": "task", "pandas_type": "unicode",
             "numpy_type": "object", "metadata": None},
        ],
        "creator": {"library": "pyarrow", "version": pa.__version__},
        "pandas_version": "2.2.3",
    }  # fmt: skip
    table = pa.table({"task_index": pa.array(range(len(tasks)), pa.int64()),
                      "task": pa.array(tasks, pa.string())})  # fmt: skip
    pq.write_table(table.replace_schema_metadata({"pandas": json.dumps(pandas_meta)}), path)


def episode_stats(values: np.ndarray, dtype: str) -> dict[str, np.ndarray]:
    """One episode's statistics of a feature, shaped as LeRobot's: a video [T, H, W, C] uint8
    gives per-channel values in [0, 1] of shape (C, 1, 1) (over at most `STAT_FRAMES` frames); a
    scalar [T] shape (1,); a vector [T, n] shape (n,). ``count`` is (1,)."""
    x = np.asarray(values)
    if dtype == "video":
        pick = np.linspace(0, len(x) - 1, min(len(x), STAT_FRAMES)).round().astype(int)
        x = x[pick].astype(np.float64) / 255.0
        n, flat = len(x), x.transpose(3, 0, 1, 2).reshape(x.shape[3], -1).T  # (N*H*W, C)
        shape = (-1, 1, 1)
    else:
        n, flat = len(x), x.reshape(len(x), -1).astype(np.float64)  # (T, n)
        shape = (-1,)
    out = {"min": flat.min(0), "max": flat.max(0), "mean": flat.mean(0), "std": flat.std(0)}
    for q in QUANTILES:
        out[f"q{round(q * 100):02d}"] = np.quantile(flat, q, axis=0)
    out = {k: v.reshape(shape) for k, v in out.items()}
    out["count"] = np.array([n])
    return out


def aggregate_stats(stats: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Episodes' statistics of one feature -> the dataset's (as LeRobot aggregates them:
    count-weighted means, pooled variance, min of mins, count-weighted quantiles)."""
    counts = np.array([s["count"][0] for s in stats], np.float64)
    w = counts.reshape(-1, *[1] * stats[0]["mean"].ndim) / counts.sum()
    mean = (np.stack([s["mean"] for s in stats]) * w).sum(0)
    var = ((np.stack([s["std"] for s in stats]) ** 2 +
            (np.stack([s["mean"] for s in stats]) - mean) ** 2) * w).sum(0)  # fmt: skip
    out = {"min": np.min([s["min"] for s in stats], 0), "max": np.max([s["max"] for s in stats], 0),
           "mean": mean, "std": np.sqrt(var), "count": np.array([int(counts.sum())])}  # fmt: skip
    for key in (k for k in stats[0] if k[0] == "q" and k[1:].isdigit()):
        out[key] = (np.stack([s[key] for s in stats]) * w).sum(0)
    return out


# ---------------------------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------------------------


class DatasetReader:
    """A LeRobot v3.x dataset folder, checked when opened (info, tasks, episodes metadata).

    Attributes: ``root``, ``info`` (``meta/info.json``), ``fps``, ``features`` (name -> dtype,
    shape as a tuple, names), ``video_keys``, ``tasks`` (task_index -> string) and ``episodes``
    (one metadata dict per episode, by episode index; the ``stats/*`` columns left out).
    """

    def __init__(self, root: str | Path):
        self.root = Path(root).expanduser()
        self.info = read_info(self.root)
        self.fps = int(self.info["fps"])
        self.features = {
            k: {**v, "shape": tuple(v["shape"])} for k, v in self.info["features"].items()
        }
        self.video_keys = [k for k, v in self.features.items() if v["dtype"] == "video"]
        self.tasks = read_tasks(self.root)
        self.episodes = read_episodes(self.root)
        self._tables: dict[Path, dict[str, np.ndarray]] = {}

    def __len__(self) -> int:
        return len(self.episodes)

    def _file(self, template: str, what: str, **kw) -> Path:
        path = self.root / template.format(**kw)
        if not path.exists():
            raise DataError(
                f"{path}: the {what} file that meta/episodes names is missing; the dataset "
                f"{self.root} is incomplete (copy it whole, or record it again)"
            )
        return path

    def columns(self, index: int, keys: list[str] | None = None) -> dict[str, np.ndarray]:
        """Episode ``index``'s non-video features as arrays [T, ...] (scalars [T]), every one
        or ``keys``; plus ``task``: its frames' task strings (a list of T)."""
        ep = self.episodes[index]
        path = self._file(self.info["data_path"], "data", chunk_index=ep["data/chunk_index"],
                          file_index=ep["data/file_index"])  # fmt: skip
        table = self._tables.get(path)
        if table is None:
            table = self._tables[path] = _read_columns(path, self.features)
        rows = np.flatnonzero(table["episode_index"] == ep["episode_index"])
        wanted = keys or [k for k in table if k in self.features]
        missing = [k for k in wanted if k not in table]
        if missing:
            raise DataError(f"{path}: no column {missing[0]!r}, which info.json lists")
        out = {k: table[k][rows] for k in wanted}
        out["task"] = [self.tasks.get(int(t), "") for t in table["task_index"][rows]]
        return out

    def video_path(self, key: str, index: int) -> Path:
        ep = self.episodes[index]
        return self._file(self.info["video_path"], "video", video_key=key,
                          chunk_index=ep[f"videos/{key}/chunk_index"],
                          file_index=ep[f"videos/{key}/file_index"])  # fmt: skip

    def frames(self, key: str, index: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Frames ``start:stop`` of episode ``index`` of camera ``key``: [n, H, W, 3] uint8 RGB
        (decoded with PyAV). Raises `DataError` naming the file, episode and frame when the
        video cannot be decoded or ends early."""
        ep = self.episodes[index]
        stop = ep["length"] if stop is None else stop
        path = self.video_path(key, index)
        first = round(ep[f"videos/{key}/from_timestamp"] * self.fps) + start
        codec = self.features[key].get("info", {}).get("video.codec")
        import av  # the video decoder; imported where a video is read

        try:
            out = decode_frames(path, first, stop - start, self.fps)
        except (av.FFmpegError, ValueError) as e:
            fix = _video_fix(codec)
            raise DataError(f"{path}: this video does not decode ({key}: {e}); {fix}") from None
        if len(out) < stop - start:
            t = start + len(out)
            raise DataError(
                f"{path}: no frame {t} of episode {ep['episode_index']} (video frame "
                f"{first + t - start}) could be decoded ({key}); {_video_fix(codec)}"
            )
        return np.stack(out) if out else np.zeros((0, *self.features[key]["shape"]), np.uint8)


def decode_frames(path: Path, first: int, count: int, fps: int) -> list[np.ndarray]:
    """Up to ``count`` RGB frames [H, W, 3] uint8 of the video at ``path`` from frame ``first``
    (the frame shown at ``first / fps`` seconds): seek to the key frame before it, then decode
    on, keeping the frames whose time rounds to ``first`` .. ``first + count - 1``."""
    import av

    out: list[np.ndarray] = []
    if count <= 0:
        return out
    with av.open(str(path)) as container:
        if not container.streams.video:
            raise ValueError("the file holds no video stream")
        stream = container.streams.video[0]
        if first > 0:
            container.seek(int(first / fps / stream.time_base), stream=stream, backward=True)
        for frame in container.decode(stream):
            k = round(frame.time * fps) if frame.time is not None else first + len(out)
            if k >= first:
                out.append(frame.to_ndarray(format="rgb24"))
            if len(out) == count:
                break
    return out


def _video_fix(codec: str | None) -> str:
    """What to do about a video that does not decode, given its codec (``info.json``)."""
    return (
        f"the file is damaged or in a codec this FFmpeg build cannot decode ({codec}): copy the "
        "dataset again, or re-encode its videos (e.g. `ffmpeg -i file-000.mp4 -c:v libx264 "
        "-pix_fmt yuv420p -g 2 out.mp4` for each file, then move out.mp4 over it)"
    )


def read_info(root: Path) -> dict:
    """``meta/info.json`` of a v3.x dataset; a `DataError` when the folder is not one."""
    path = root / INFO_PATH
    if not path.is_file():
        raise DataError(
            f"{root} is not a LeRobot dataset: {INFO_PATH} is missing; give the dataset's root "
            "folder (the one holding meta/, data/ and videos/)"
        )
    try:
        info = json.loads(path.read_text())
        version, features = str(info["codebase_version"]), info["features"]
        int(info["fps"]), info["data_path"]
    except (ValueError, KeyError, TypeError) as e:
        raise DataError(f"{path}: not a LeRobot info.json ({type(e).__name__}: {e})") from None
    if not version.startswith("v3."):
        raise DataError(
            f"{path}: codebase_version {version}; this reader reads v3.x datasets. Convert it "
            "with LeRobot's converter (python -m lerobot.datasets.v30.convert_dataset_v21_to_v30)"
        )
    for name, ft in features.items():
        if not isinstance(ft, dict) or "dtype" not in ft or "shape" not in ft:
            raise DataError(f"{path}: feature {name!r} has no dtype and shape ({ft!r})")
    return info


def read_tasks(root: Path) -> dict[int, str]:
    """``meta/tasks.parquet`` -> task_index -> task string (the string is the pandas index
    column, ``task`` or an unnamed ``__index_level_0__``)."""
    path = root / TASKS_PATH
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as e:
        raise DataError(f"{path}: cannot read the dataset's tasks ({e})") from None
    names = [n for n in table.column_names if n != "task_index"]
    if "task_index" not in table.column_names or not names:
        raise DataError(f"{path}: expected columns task_index and the task string")
    text = table.column("task" if "task" in names else names[0]).to_pylist()
    return dict(zip(table.column("task_index").to_pylist(), map(str, text)))


def read_episodes(root: Path) -> list[dict]:
    """Every row of ``meta/episodes/*/*.parquet`` but the statistics, by episode index."""
    paths = sorted((root / "meta" / "episodes").glob("chunk-*/file-*.parquet"))
    if not paths:
        raise DataError(
            f"{root}: no meta/episodes/chunk-*/file-*.parquet; the dataset is incomplete"
        )
    rows = []
    for path in paths:
        try:
            schema = pq.read_schema(path)
            keep = [n for n in schema.names if not n.startswith("stats/")]
            rows += pq.read_table(path, columns=keep).to_pylist()
        except (OSError, pa.ArrowException) as e:
            raise DataError(f"{path}: cannot read the episodes metadata ({e})") from None
    rows.sort(key=lambda r: r["episode_index"])
    need = ("episode_index", "length", "data/chunk_index", "data/file_index")
    missing = [k for k in need if k not in rows[0]]
    if missing:
        raise DataError(f"{paths[0]}: the episodes metadata lacks {missing}")
    return rows


def _read_columns(path: Path, features: dict) -> dict[str, np.ndarray]:
    """A data file's columns as numpy: scalars [N], lists of n values [N, n] (fixed-size or
    not, each row the feature's size)."""
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as e:
        raise DataError(f"{path}: cannot read this data file ({e})") from None
    out = {}
    for name in table.column_names:
        col = table.column(name).combine_chunks()
        if pa.types.is_list(col.type) or pa.types.is_fixed_size_list(col.type):
            n = math.prod(features.get(name, {}).get("shape", (0,)))
            flat = col.flatten().to_numpy(zero_copy_only=False)
            if n == 0 or flat.size != n * len(col):
                raise DataError(
                    f"{path}: column {name!r} holds {flat.size} values for {len(col)} frames; "
                    f"info.json gives it shape {features.get(name, {}).get('shape')}"
                )
            out[name] = flat.reshape(len(col), *features[name]["shape"])
        elif (
            pa.types.is_integer(col.type)
            or pa.types.is_floating(col.type)
            or (pa.types.is_boolean(col.type))
        ):
            out[name] = col.to_numpy(zero_copy_only=False)
    for need in ("episode_index", "task_index"):
        if need not in out:
            raise DataError(f"{path}: the data file has no {need} column")
    return out
