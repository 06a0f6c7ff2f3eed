"""Videos of evaluated episodes (``shoal evaluate CHECKPOINT --video DIR``): one file per episode.

The episodes are played by an evaluation :class:`~orchestration.actor.Actor` (the rules of
:func:`orchestration.builder.build_evaluator`: learned policies act with their modes, fixed ones sample) on
one env built with ``render_mode="rgb_array"``; the frame of that env is kept after its reset and after every
step. Gymnasium envs and PettingZoo envs (parallel or AEC) that render ``rgb_array`` frames can be filmed;
Shoal's built-in envs, VMAS scenarios and external simulators cannot (:class:`VideoError`).

Encoders: MP4 (H.264) through ``imageio-ffmpeg`` (``pip install 'shoal[video]'``: it ships its own ffmpeg), else
an animated GIF through Pillow (installed with matplotlib). The adapters reset a finished env inside the step
that ends its episode, so the frame after each step is taken inside the env's own ``step``, before that reset:
an episode of T steps gives T + 1 frames, its last one the state its last action led to.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any, Collection, Literal, Mapping

import numpy as np

from core.layout import DONE, NEXT
from orchestration.user_errors import is_users_mistake

Format = Literal["auto", "mp4", "gif"]


class VideoError(ValueError):
    """The env cannot be filmed (no ``rgb_array`` rendering); a user error, named in one paragraph."""


def video_format(fmt: Format = "auto") -> str:
    """``"mp4"`` when ``imageio-ffmpeg`` is installed (or asked for), else ``"gif"``."""
    if fmt == "auto":
        return "mp4" if importlib.util.find_spec("imageio_ffmpeg") is not None else "gif"
    if fmt == "mp4" and importlib.util.find_spec("imageio_ffmpeg") is None:
        raise ImportError("MP4 videos need imageio-ffmpeg: pip install 'shoal[video]' (or record GIFs)")
    if fmt not in ("mp4", "gif"):
        raise ValueError(f"video format must be 'auto', 'mp4' or 'gif', got {fmt!r}")
    return fmt


def _unfilmable(env_name: str, why: str) -> VideoError:
    return VideoError(f"--video: env {env_name!r} cannot be filmed: {why}. Videos need an env that renders "
                      f"rgb_array frames: a gymnasium env (e.g. CartPole-v1) or a PettingZoo env (e.g. "
                      f"mpe2:simple_spread_v3) whose render_mode='rgb_array' returns images; evaluate this one "
                      f"without --video")


def _frame_source(env, env_name: str):
    """The first env of a batch, which renders: PettingZoo adapters keep their copies in ``envs``, gymnasium's a
    vector env (``env.envs``) or a single env (``env``)."""
    inner = getattr(env, "envs", None) or getattr(getattr(env, "env", None), "envs", None)
    source = inner[0] if inner else getattr(env, "env", None)
    if source is None or not callable(getattr(source, "render", None)):
        raise _unfilmable(env_name, f"its adapter ({type(env).__name__}) has no env that renders")
    modes = (getattr(source, "metadata", None) or {}).get("render_modes", [])
    if "rgb_array" not in modes:
        raise _unfilmable(env_name, f"its render modes are {list(modes)}, without 'rgb_array'")
    return source


class _Filming:
    """A batched env (``num_envs == 1``) that hands every frame of env 0 to ``on_frame(frame, new_episode)``;
    everything else is delegated to the env."""

    def __init__(self, env, source, env_name: str, on_frame) -> None:
        self._env, self._source, self._name, self._on_frame = env, source, env_name, on_frame
        self._stepped: np.ndarray | None = None  # the frame right after the source's last step, before any reset
        step = source.step

        def filmed_step(*args, **kwargs):  # the adapter resets an ended episode inside its own step: film first
            out = step(*args, **kwargs)
            self._stepped = self._frame()
            return out

        source.step = filmed_step

    def __getattr__(self, name: str) -> Any:
        return getattr(self._env, name)

    def _frame(self) -> np.ndarray:
        frame = self._source.render()
        if isinstance(frame, list) and frame:  # a render_mode="rgb_array_list" style answer
            frame = frame[-1]
        if not (isinstance(frame, np.ndarray) and frame.ndim == 3 and frame.shape[-1] in (3, 4)):
            raise _unfilmable(self._name, f"render() returned {type(frame).__name__}"
                              + (f" of shape {frame.shape}" if isinstance(frame, np.ndarray) else "")
                              + ", not an [H, W, 3] image")
        return np.ascontiguousarray(frame[..., :3], dtype=np.uint8)

    def reset(self, seed: int | None = None):
        out = self._env.reset(seed=seed)
        self._on_frame(self._frame(), True)
        return out

    def step(self, actions):
        self._stepped = None
        out = self._env.step(actions)
        stepped = self._stepped if self._stepped is not None else self._frame()
        self._on_frame(stepped, False)  # at an episode's end: its last frame
        if bool(out.get((NEXT, DONE)).reshape(-1)[0]):  # the next episode's first frame (the adapter reset it); an
            cut = 0 in np.asarray(getattr(self._env, "last_cut", ()))  # episode a lenient repair cut is not scored:
            self._on_frame(self._frame(), True, cut)                    # its video is dropped
        return out


class _Writer:
    """One video file, fed frame by frame: MP4 streamed to ffmpeg, or a GIF written when closed."""

    def __init__(self, path: Path, fmt: str, fps: float) -> None:
        self.path, self.fmt, self.fps, self.frames = path, fmt, fps, 0
        self._mp4 = None
        self._gif: list = []

    def add(self, frame: np.ndarray) -> None:
        h, w = frame.shape[:2]
        if self.fmt == "mp4":
            frame = np.pad(frame, ((0, h % 2), (0, w % 2), (0, 0)))  # H.264 in yuv420p needs even sizes
            if self._mp4 is None:
                import imageio_ffmpeg

                self._mp4 = imageio_ffmpeg.write_frames(str(self.path), (w + w % 2, h + h % 2), fps=self.fps,
                                                        codec="libx264", pix_fmt_in="rgb24", macro_block_size=2,
                                                        ffmpeg_log_level="error")
                self._mp4.send(None)
            self._mp4.send(np.ascontiguousarray(frame))
        else:
            from PIL import Image

            image = Image.fromarray(frame)
            if max(h, w) > 400:  # GIFs keep every frame until written: half size, a quarter of the memory
                image = image.reduce(2)
            self._gif.append(image.quantize(colors=64, method=Image.Quantize.FASTOCTREE))
        self.frames += 1

    def close(self) -> Path | None:
        """Writes the file; its path, or None when no frame came."""
        if self._mp4 is not None:
            self._mp4.close()
        elif self._gif:
            self._gif[0].save(self.path, save_all=True, append_images=self._gif[1:], loop=0,
                              duration=max(20, round(1000 / self.fps)))
            self._gif = []
        return self.path if self.frames else None


def record_episodes(config, policies: Mapping[str, Any], assignment: Mapping[str, Any], fixed: Collection[str], *,
                    episodes: int, out_dir: str | Path, fmt: Format = "auto",
                    ) -> tuple[dict[str, list[float]], list[Path]]:
    """Plays ``episodes`` episodes of ``config.env`` on one rendering env and writes one video per episode.

    Args:
        config: the run's :class:`~orchestration.config.TrainConfig` (env, env kwargs, seed, check mode).
        policies: policy id -> module with the checkpoint's weights; ``fixed``: the ids that sample.
        assignment: group -> policies acting in it (:func:`orchestration.builder.assignment_for`).
        episodes: episodes to play and film.
        out_dir: directory for ``episode_000.mp4`` (or ``.gif``) and the next ones; created when missing.
        fmt: ``"mp4"``, ``"gif"`` or ``"auto"`` (:func:`video_format`).

    Returns:
        The returns per finished episode (as :meth:`Actor.run_episodes`) and the video paths, in episode order.

    Raises:
        VideoError: the env does not render ``rgb_array`` frames (named, with what can be filmed).
    """
    from orchestration.actor import Actor
    from orchestration.envs import make_env, parse_kwargs

    fmt = video_format(fmt)
    name = config.env
    if name == "external" or name.startswith(("builtin:", "vmas:")):
        raise _unfilmable(name, "Shoal's built-in envs, VMAS scenarios and external simulators do not render "
                                "frames here")
    out = Path(out_dir)
    try:  # before the env is made: a file in the way, or no permission, is said first
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValueError(f"--video {out_dir}: cannot make that directory ({error.strerror or error})") from None
    os.environ.setdefault("SDL_VIDEODRIVER", "dummy")  # pygame-drawn envs render without a display
    kwargs = {**parse_kwargs(config.env_kwargs), "render_mode": "rgb_array"}
    try:
        env = make_env(name, 1, check=config.rollout.check, kwargs=kwargs,
                       shared_state=None if config.policy.critic != "local" else False)
    except TypeError as err:
        raise _unfilmable(name, f"its constructor takes no render_mode ({err})") from None
    written: list[Path] = []
    writer: list[_Writer] = []  # the episode being filmed

    def on_frame(frame: np.ndarray, new_episode: bool, cut: bool = False) -> None:
        if new_episode:
            if writer and (path := writer.pop().close()) is not None:
                path.unlink() if cut else written.append(path)
            if len(written) >= episodes:
                return
            writer.append(_Writer(out / f"episode_{len(written):03d}.{fmt}", fmt, fps))
        if writer:
            writer[0].add(frame)

    try:
        source = _frame_source(env, name)
        fps = float((source.metadata or {}).get("render_fps") or 30)
        filming = _Filming(env, source, name, on_frame)
        actor = Actor(filming, {pid: p.cpu() for pid, p in policies.items()}, assignment,
                      seed=config.seed + 10**6, record=False, deterministic=[p for p in policies if p not in fixed])
        returns = actor.run_episodes(episodes)
    except Exception as error:  # the env's own fault while filmed (VideoErrors and the user's mistakes pass)
        if isinstance(error, VideoError) or is_users_mistake(error, gymnasium=True):
            raise
        raise VideoError(f"--video: env {name!r} failed while it was filmed ({type(error).__name__}: {error}); "
                         f"videos play the env in this process, where --rollout.check lenient cannot restart it: "
                         f"evaluate without --video to score it, or film a checkpoint of an env that runs") from None
    finally:
        if writer and (path := writer.pop().close()) is not None:  # an episode cut short: no half-written file
            path.unlink()
        env.close()
    return returns, written


__all__ = ["VideoError", "record_episodes", "video_format"]
