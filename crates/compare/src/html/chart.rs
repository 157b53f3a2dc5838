//! The per-layer chart of the report page: the largest difference per layer along the whole
//! run, log scale.

use crate::bisect::LayerPoint;
use crate::report::g;
use std::fmt::Write;

/// Chart geometry (SVG user units).
const W: f64 = 760.0;
const H: f64 = 320.0;
const LEFT: f64 = 70.0;
const BOTTOM: f64 = 96.0;
const TOP: f64 = 16.0;

/// The per-layer chart: one `<circle class="pt">` per layer, its height log10 of the layer's
/// largest difference; layers with no difference sit on the axis (class `pt zero`), those with
/// a NaN/±Inf on one side only at the top (class `pt nonfinite`); the root cause's layer
/// `root` is ringed (class `pt root`). Axis titles name both axes.
pub fn chart(points: &[LayerPoint], root: Option<&str>) -> String {
    let finite: Vec<f64> = points.iter().map(|p| p.max_abs_diff).filter(|d| d.is_finite() && *d > 0.0).collect();
    let (lo, hi) = match (finite.iter().copied().reduce(f64::min), finite.iter().copied().reduce(f64::max)) {
        (Some(a), Some(b)) => (a.log10().floor(), b.log10().ceil().max(a.log10().floor() + 1.0)),
        _ => (-8.0, 0.0),
    };
    let plot_h = H - TOP - BOTTOM;
    let y_of = |d: f64| -> f64 {
        if d.is_nan() {
            TOP
        } else if d <= 0.0 {
            H - BOTTOM
        } else {
            H - BOTTOM - (d.log10() - lo) / (hi - lo) * plot_h
        }
    };
    let n = points.len().max(1) as f64;
    let x_of = |i: usize| LEFT + (i as f64 + 0.5) * (W - LEFT - 10.0) / n;
    let mut o = String::new();
    let _ = write!(o, r#"<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {W} {H}" width="{W}" height="{H}" role="img" aria-label="largest difference per layer, log scale">"#);
    let _ = write!(o, r#"<line x1="{LEFT}" y1="{}" x2="{W}" y2="{}" class="axis"/><line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{}" class="axis"/>"#, H - BOTTOM, H - BOTTOM, H - BOTTOM);
    let mid = TOP + (H - BOTTOM - TOP) / 2.0;
    let _ = write!(
        o,
        r#"<text x="14" y="{mid:.1}" class="title" transform="rotate(-90 14 {mid:.1})">max |a-b| (log)</text><text x="{:.1}" y="{:.1}" class="title">layer (execution order)</text>"#,
        LEFT + (W - LEFT) / 2.0,
        H - 6.0
    );
    let mut e = lo as i32;
    while e as f64 <= hi {
        let y = y_of(10f64.powi(e));
        let _ = write!(o, r#"<line x1="{LEFT}" y1="{y:.1}" x2="{W}" y2="{y:.1}" class="grid"/><text x="{}" y="{:.1}" class="tick">1e{e}</text>"#, LEFT - 6.0, y + 4.0);
        e += 1;
    }
    let mut path = String::new();
    for (i, p) in points.iter().enumerate() {
        let (x, y) = (x_of(i), y_of(p.max_abs_diff));
        let _ = write!(path, "{}{x:.1},{y:.1}", if i == 0 { "M" } else { " L" });
    }
    let _ = write!(o, r#"<path d="{path}" class="line"/>"#);
    for (i, p) in points.iter().enumerate() {
        let (x, y) = (x_of(i), y_of(p.max_abs_diff));
        let class = if p.max_abs_diff.is_nan() {
            "pt nonfinite"
        } else if p.differing == 0 {
            "pt zero"
        } else {
            "pt"
        };
        if root == Some(p.layer.as_str()) {
            let _ = write!(o, r#"<circle cx="{x:.1}" cy="{y:.1}" r="8" class="pt root"><title>the root cause's layer</title></circle>"#);
        }
        let what = if p.max_abs_diff.is_nan() {
            "NaN/Inf on one side".to_string()
        } else if p.differing == 0 {
            "identical".to_string()
        } else {
            format!("max |a-b| ≥ {}", g(p.max_abs_diff))
        };
        let _ = write!(
            o,
            r#"<circle cx="{x:.1}" cy="{y:.1}" r="4" class="{class}" data-layer="{}"><title>{}: {what} ({}/{} differ)</title></circle>"#,
            p.layer.html(),
            p.layer.html(),
            p.differing,
            p.compared
        );
        if points.len() <= 40 || i % (points.len() / 20).max(1) == 0 {
            let _ = write!(o, r#"<text x="{x:.1}" y="{:.1}" class="lab" transform="rotate(45 {x:.1} {:.1})">{}</text>"#, H - BOTTOM + 12.0, H - BOTTOM + 12.0, p.layer.html());
        }
    }
    o.push_str("</svg>");
    o
}
