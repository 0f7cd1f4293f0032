"""The report's HTML: one page, its style inline, its charts inline SVG (``svg.py``), its data read by
``data.py``. No script, no link, no image file and no font to fetch: it opens from disk anywhere.

Sections: the header (settings and the run's summary), reward and held-out accuracy, the critic (its
explained variance over steps, by response position and by turn, its calibration), the critic's
advantages against GRPO's and RLOO's, what the critic costs, and the step budget. A panel whose metrics
the run did not log says so in one line.
"""

from __future__ import annotations

from collections.abc import Sequence
from html import escape

import ppo_driver.report.svg as svg
from ppo_driver import __version__
from ppo_driver.report.data import (
    BASELINES,
    CRITIC_MARK,
    WINDOW,
    Budget,
    Run,
    Series,
    budget,
    calibration,
    essentials,
    position_keys,
    series,
    setting,
    steps_text,
    summary_lines,
    turn_keys,
    window_mean,
)

STYLE = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: #222;
       margin: 0 auto; padding: 16px 24px 40px; max-width: 1180px; background: #fff; }
h1 { font-size: 22px; margin: 4px 0 2px; } h2 { font-size: 17px; margin: 28px 0 6px;
     border-bottom: 1px solid #ddd; padding-bottom: 3px; }
.sub { color: #666; margin: 0 0 10px; word-break: break-all; }
table { border-collapse: collapse; font-size: 12.5px; }
td, th { padding: 2px 10px 2px 0; text-align: left; vertical-align: top; }
th { color: #555; font-weight: 600; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
table.settings td:first-child { color: #555; padding-right: 18px; }
ul.summary { margin: 8px 0; padding-left: 20px; } ul.summary li { margin: 2px 0; }
.grid { display: flex; flex-wrap: wrap; gap: 12px 24px; }
figure { margin: 0; } figcaption { font-size: 12px; color: #555; max-width: 560px; }
p.missing { color: #8a5a00; background: #fff8e6; border-left: 3px solid #e0a800; padding: 4px 10px;
            margin: 6px 0; }
p.note { color: #555; font-size: 12.5px; margin: 4px 0; }
svg.chart { background: #fcfcfc; border: 1px solid #eee; }
svg text { font-family: system-ui, sans-serif; fill: #333; }
svg .title { font-size: 13px; font-weight: 600; } svg .tick, svg .legend { font-size: 11px; }
svg .axis-label { font-size: 11px; fill: #555; } svg .none { font-size: 12px; fill: #999; }
svg .grid { stroke: #e6e6e6; } svg .axis { stroke: #999; }
svg .ref { stroke: #888; stroke-dasharray: 4 3; }
svg .clipped { fill: #fff; stroke-width: 1.5; } svg rect.cut { opacity: 0.55; }
"""


NUM, STRONG = ' class="num"', ' style="font-weight: 600"'


def render(run: Run) -> str:
    """The whole page for ``run``."""
    name = run.run_dir.resolve().name or str(run.run_dir)
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>ppo-driver report: {escape(name)}</title>",
        f"<style>{STYLE}</style></head><body>",
        *_header(run, name),
        *_rewards(run),
        *_critic(run),
        *_advantages(run),
        *_critic_cost(run),
        *_budget(run),
        f'<p class="note">Written by ppo-driver {escape(__version__)} from {escape(str(run.run_dir))}/'
        f"metrics.jsonl ({len(run.records)} steps). Hover over a point or a bar for its value.</p>",
        "</body></html>",
    ]
    return "\n".join(parts) + "\n"


# ---------------------------------------------------------------------------------- pieces


def _missing(text: str) -> str:
    return f'<p class="missing">{escape(text)}</p>'


def _figure(chart: str, caption: str = "") -> str:
    below = f"<figcaption>{escape(caption)}</figcaption>" if caption else ""
    return f"<figure>{chart}{below}</figure>"


def _num(value: float | None, spec: str = ".4g") -> str:
    return "-" if value is None else format(value, spec)


def _values_table(rows: Sequence[Series], spec: str = ".4g") -> str:
    """Per series: the first and last step's value, the mean of the last steps, the range."""
    head = (
        '<table class="values"><tr><th>metric</th><th class="num">first</th><th class="num">last</th>'
        f'<th class="num">mean of the last {WINDOW}</th><th class="num">min</th><th class="num">max</th></tr>'
    )
    body = []
    for s in rows:
        if not s:
            continue
        body.append(
            f"<tr><td>{escape(s.key)}</td>"
            f'<td class="num">{_num(s.values[0], spec)} <small>(step {s.steps[0]})</small></td>'
            f'<td class="num">{_num(s.values[-1], spec)} <small>(step {s.steps[-1]})</small></td>'
            f'<td class="num">{_num(s.last_mean(), spec)}</td>'
            f'<td class="num">{_num(min(s.values), spec)}</td>'
            f'<td class="num">{_num(max(s.values), spec)}</td></tr>'
        )
    return head + "".join(body) + "</table>" if body else ""


def _line_panel(title: str, lines: Sequence[Series], axis: svg.Axis, missing: str, caption: str = "") -> str:
    present = [s for s in lines if s]
    if not present:
        return _missing(missing)
    chart, clipped = svg.line_chart(title, [svg.Line(s.label, s.steps, s.values) for s in present], axis)
    if clipped:
        edge = " or ".join(f"{b:g}" for b in (axis.lo, axis.hi) if b is not None)
        caption += f" {clipped} values beyond {edge} are drawn on the axis's edge as open circles."
    return _figure(chart, caption.strip())


def _grid(panels: Sequence[str]) -> list[str]:
    """Charts side by side; the one-line notes of panels without data below them, not between."""
    charts = [p for p in panels if not p.startswith('<p class="missing">')]
    notes = [p for p in panels if p.startswith('<p class="missing">')]
    return ['<div class="grid">', *charts, "</div>", *notes] if charts else notes


def _header(run: Run, name: str) -> list[str]:
    rows = "".join(f"<tr><td>{escape(k)}</td><td>{escape(v)}</td></tr>" for k, v in essentials(run))
    out = [
        f"<h1>ppo-driver report: {escape(name)}</h1>",
        f'<p class="sub">{escape(str(run.run_dir.resolve()))}</p>',
        f'<table class="settings">{rows}</table>',
        '<ul class="summary">' + "".join(f"<li>{escape(line)}</li>" for line in summary_lines(run)) + "</ul>",
    ]
    out += [f'<p class="note">{escape(note)}</p>' for note in run.notes]
    return out


def _rewards(run: Run) -> list[str]:
    r = run.records
    reward = [
        series(r, "rollout/reward_mean", "training reward (mean)"),
        series(r, "eval/reward_mean", "held-out reward, greedy"),
        series(r, "eval/sampled_reward_mean", "held-out reward, sampled"),
    ]
    accuracy = [
        series(r, "eval/accuracy", "held-out accuracy, greedy"),
        series(r, "eval/sampled_accuracy", "held-out accuracy, sampled"),
    ]
    evals = [s for s in accuracy if s]
    caption = ""
    if evals and len(evals[0].steps) <= 3:
        caption = f"Evaluated at {', '.join(f'step {s}' for s in evals[0].steps)} (rollout.eval_interval)."
    panels = [
        _line_panel("reward", reward, svg.Axis(label="reward"), "no reward logged in metrics.jsonl"),
        _line_panel(
            "held-out accuracy",
            accuracy,
            svg.Axis(label="accuracy", lo=0.0, hi=1.0, percent=True, whole=True),
            "no held-out evaluation in this run (rollout.eval_prompts: 0, or no evaluation step yet)",
            caption,
        ),
    ]
    return ["<h2>Reward and held-out accuracy</h2>", *_grid(panels), _values_table([*reward, *accuracy])]


def _critic(run: Run) -> list[str]:
    out = ["<h2>The critic: how well its values predict the returns</h2>"]
    steps = run.critic_steps
    if not steps:
        return [*out, _missing(_no_critic(run))]
    ev = [
        series(run.records, "critic/explained_variance", "explained variance"),
        series(run.records, "critic/first_value_vs_score_corr", "first value vs score, correlation"),
    ]
    if not any(ev) and not any(k.startswith("critic/calib_") for k in steps[-1]):
        return [*out, _missing("no critic-health metrics in this run (logging.critic_health: false)")]
    first, last = steps[:WINDOW], steps[-WINDOW:]
    windows = [
        (f"first {len(first)} ({steps_text(first)})", first),
        (f"last {len(last)} ({steps_text(last)})", last),
    ]
    if first == last:
        windows = windows[1:]
    ev_axis = svg.Axis(label="explained variance", lo=-1.0, hi=1.0, ref=0.0)
    panels = [
        _line_panel(
            "explained variance over steps",
            ev,
            ev_axis,
            "no explained variance logged (critic/explained_variance)",
            "1: the values predict the returns; 0: no better than their mean; below 0: worse.",
        ),
        _bucket_panel(
            "explained variance by response position",
            [f"{10 * b}-{10 * b + 10}%" for b in range(len(position_keys()))],
            position_keys(),
            windows,
            "no explained variance per response position logged (critic/ev_pos_*)",
            "position of a token in its own response",
        ),
        _bucket_panel(
            "explained variance by turn",
            [f"turn {t}" for t in range(1, len(turn_keys()) + 1)],
            turn_keys(),
            windows,
            "single-turn samples only: no explained variance per turn (critic/ev_turn_* come with multi-turn "
            "samples)",
            "turn of the sample (the last holds every later turn)",
            drop_empty=True,
        ),
        _calibration_panel(windows),
    ]
    return [*out, *_grid(panels), _values_table(ev)]


def _no_critic(run: Run) -> str:
    estimator = setting(run.config, "algorithm.estimator")
    how = f" (algorithm.estimator: {estimator})" if estimator else ""
    return f"no critic in this run{how}: no {CRITIC_MARK} in metrics.jsonl, so no critic panels"


def _bucket_panel(
    title: str,
    categories: list[str],
    keys: list[str],
    windows: list[tuple[str, list[dict]]],
    missing: str,
    x_label: str,
    *,
    drop_empty: bool = False,
) -> str:
    """Grouped bars of ``keys`` (one per category), one bar per window of steps; ``drop_empty``: leave
    out the categories no step logged (turns the samples never reached) instead of drawing a dash."""
    groups = [(f"steps: {name}", [window_mean(rows, k) for k in keys]) for name, rows in windows]
    used = [i for i in range(len(keys)) if any(vs[i] is not None for _, vs in groups)]
    if not used:
        return _missing(missing)
    if drop_empty:
        categories, groups = [categories[i] for i in used], [(g, [vs[i] for i in used]) for g, vs in groups]
    axis = svg.Axis(label="explained variance", lo=-1.0, hi=1.0, ref=0.0)
    chart, cut = svg.bar_chart(title, categories, groups, axis, x_label=x_label)
    caption = "Mean over the steps named; a dash: no token there (a bucket the responses never reach)."
    if cut:
        caption += f" {cut} bars below -1 or above 1 are cut at the axis's edge (paler); hover for the value."
    return _figure(chart, caption)


def _calibration_panel(windows: list[tuple[str, list[dict]]]) -> str:
    groups = [(f"steps: {name}", calibration(rows)) for name, rows in windows]
    groups = [(name, pts) for name, pts in groups if pts]
    if not groups:
        return _missing("no value calibration logged (critic/calib_value_d*, critic/calib_return_d*)")
    chart = svg.calibration_chart("value calibration (deciles of the values)", groups)
    rows = "".join(
        f'<tr><td>{escape(decile)}</td><td class="num">{v:.4g}</td><td class="num">{r:.4g}</td></tr>'
        for decile, v, r in ((d, v, r) for v, r, d in groups[-1][1])
    )
    table = (
        f'<table class="values"><tr><th>{escape(groups[-1][0])}</th><th class="num">mean value</th>'
        f'<th class="num">mean return</th></tr>{rows}</table>'
    )
    caption = (
        "Per decile of the values, their mean against the mean return: a calibrated critic's points lie "
        "on the dashed diagonal."
    )
    return f"<figure>{chart}<figcaption>{escape(caption)}</figcaption>{table}</figure>"


def _advantages(run: Run) -> list[str]:
    out = ["<h2>Advantages: the critic's against GRPO's and RLOO's</h2>"]
    if not run.critic_steps:
        return [*out, _missing(_no_critic(run))]
    names = {"grpo": "GRPO", "rloo": "RLOO"}
    ratios = [
        series(run.records, f"critic/adv_var_ratio_{b}", f"{names.get(b, b)} / critic") for b in BASELINES
    ]
    corrs = [series(run.records, f"critic/adv_corr_{b}", f"with {names.get(b, b)}") for b in BASELINES]
    if not any(ratios) and not any(corrs):
        return [
            *out,
            _missing(
                "no advantage comparison logged (critic/adv_var_ratio_*): it needs two or more samples per "
                "prompt on a rank (rollout.sampling.n_samples_per_prompt) and logging.critic_health"
            ),
        ]
    words = []
    for b, ratio in zip(BASELINES, ratios, strict=True):
        mean = ratio.last_mean()
        if mean is not None and mean > 0:
            how = f"{mean:.2f}x lower" if mean >= 1 else f"{1 / mean:.2f}x higher"
            words.append(f"the critic's advantage variance is {how} than {names.get(b, b)}'s")
    note = f"Mean of the last {WINDOW} steps: {'; '.join(words)}." if words else ""
    panels = [
        _line_panel(
            "advantage variance ratio (baseline / critic)",
            ratios,
            svg.Axis(label="variance ratio", log=True, ref=1.0),
            "no advantage variance ratio logged (critic/adv_var_ratio_*)",
            "Above 1 (dashed): the critic's advantages vary less than the group baseline's on the same "
            "samples.",
        ),
        _line_panel(
            "advantage correlation with the critic's",
            corrs,
            svg.Axis(label="correlation", lo=-1.0, hi=1.0, ref=0.0),
            "no advantage correlation logged (critic/adv_corr_*)",
            "How far the two agree on which tokens were good (token-weighted).",
        ),
    ]
    return [
        *out,
        *_grid(panels),
        f'<p class="note">{escape(note)}</p>' if note else "",
        _values_table([*ratios, *corrs]),
    ]


def _critic_cost(run: Run) -> list[str]:
    out = ["<h2>What the critic costs</h2>"]
    if not run.critic_steps:
        return [*out, _missing(_no_critic(run))]
    time_share = series(run.records, "time/critic_share", "share of the step's time")
    memory = series(run.records, "memory/critic_peak_share", "share of the trainers' peak memory")
    panels = [
        _line_panel(
            "the critic's share of a step",
            [time_share, memory],
            svg.Axis(label="share", lo=0.0, hi=1.0, percent=True, whole=True),
            "no critic cost logged (time/critic_share)",
            "Time: critic training, its sleep and wake and the value handoff over the step; memory: its "
            "peak over the actor's plus its own (CUDA).",
        )
    ]
    if time_share and not memory:
        panels.append(_missing("peak memory share not logged: it is measured on CUDA runs only"))
    return [*out, *panels, _values_table([time_share, memory], ".3f")]


def _budget(run: Run) -> list[str]:
    out = ["<h2>Step budget: where each step's seconds went</h2>"]
    b = budget(run.records)
    if b is None:
        return [*out, _missing("no step budget logged (time/step_s and the time/<part>_s keys)")]
    title = "seconds per step"
    if b.per_bar > 1:
        title += f" (each bar: the mean of {b.per_bar} steps)"
    chart = svg.stacked_bars(title, b.steps, b.parts)
    return [
        *out,
        _figure(chart, "Each bar adds up to its step: 'other' is what no named part covers."),
        _budget_table(b),
    ]


def _budget_table(b: Budget) -> str:
    rows = []
    for row in b.rows:
        strong = row.part == "step"
        cells = [
            escape(row.part),
            f"{row.first_s:.3f}",
            f"{row.first_share:.1%}",
            _num(row.mean_s, ".3f"),
            "-" if row.mean_share is None else f"{row.mean_share:.1%}",
        ]
        tds = "".join(f"<td{'' if i == 0 else NUM}>{c}</td>" for i, c in enumerate(cells))
        rows.append(f"<tr{STRONG if strong else ''}>{tds}</tr>")
    head = (
        '<tr><th>part</th><th class="num">first step s</th><th class="num">share</th>'
        '<th class="num">mean s, steps 2+</th><th class="num">share</th></tr>'
    )
    return f'<table class="values">{head}{"".join(rows)}</table>'
