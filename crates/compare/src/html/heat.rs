//! The heatmap of the report page: one batch row's difference by layer (rows) and token
//! position (columns), where it entered and how it spread. The colour scale is set by the
//! positions before the first flipped token: after it the two runs read different tokens, so
//! their (large) differences are drawn faded and do not hide the story before it.

use crate::bisect::{layer_group, Heat, Report};
use crate::report::g;
use std::fmt::Write;

/// Most columns drawn: longer runs put several positions in a column (their largest shown).
const MAX_COLS: u32 = 160;
const LEFT: f64 = 96.0;
const TOP: f64 = 30.0;
const PLOT_W: f64 = 600.0;
const BOTTOM: f64 = 46.0;

/// Colour of a difference `d`, on the log scale `lo..hi` (powers of ten).
fn colour(d: f64, lo: f64, hi: f64) -> String {
    if d.is_nan() {
        return "#6a1b9a".into();
    }
    if d == 0.0 {
        return "#e3eee3".into();
    }
    if d <= f64::MIN_POSITIVE {
        return "#fff6cc".into();
    }
    let t = ((d.log10() - lo) / (hi - lo).max(1e-9)).clamp(0.0, 1.0);
    // Pale yellow, orange, dark red.
    let (a, b, u) = if t < 0.5 { ([255.0, 236.0, 160.0], [240.0, 130.0, 50.0], t * 2.0) } else { ([240.0, 130.0, 50.0], [120.0, 10.0, 10.0], t * 2.0 - 1.0) };
    let c: Vec<String> = (0..3).map(|i| format!("{:02x}", (a[i] + (b[i] - a[i]) * u).round() as u8)).collect();
    format!("#{}", c.concat())
}

/// The scale: powers of ten around the differences before `flip` (all when there is none).
fn scale(h: &Heat, flip: Option<u32>) -> (f64, f64) {
    let before = |p: u32| flip.is_none_or(|f| p < f);
    let v: Vec<f64> = h.cells.iter().flatten().filter(|c| before(c.0) && c.1.is_finite() && c.1 > f64::MIN_POSITIVE).map(|c| c.1).collect();
    match (v.iter().copied().reduce(f64::min), v.iter().copied().reduce(f64::max)) {
        (Some(a), Some(b)) => (a.log10().floor(), b.log10().ceil().max(a.log10().floor() + 1.0)),
        _ => (-8.0, 0.0),
    }
}

/// The heatmap of `h` as an SVG, with the report's marks: the root cause (black box, class
/// `mark root`), the earliest difference when it died out (dashed blue box, `mark entry`), and
/// the first flipped token (red line, `mark flip`; faded columns after it).
pub fn heatmap(h: &Heat, r: &Report) -> String {
    let npos = h.cells.iter().flatten().map(|c| c.0.saturating_add(1)).max().unwrap_or(0);
    if h.layers.is_empty() || npos == 0 {
        return "<p>No op output was compared by position.</p>".into();
    }
    let per = npos.div_ceil(MAX_COLS);
    let cols = npos.div_ceil(per);
    let cw = PLOT_W / cols as f64;
    let ch = (280.0 / h.layers.len() as f64).clamp(6.0, 16.0);
    let plot_h = ch * h.layers.len() as f64;
    let (w, ht) = (LEFT + PLOT_W + 110.0, TOP + plot_h + BOTTOM);
    let flip = r.first_token_divergence.as_ref().filter(|t| t.row == h.row).map(|t| t.pos);
    let (lo, hi) = scale(h, flip);
    let x_of = |p: u32| LEFT + (p / per) as f64 * cw;
    let mut o = String::new();
    let _ = write!(o, r#"<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {w} {ht:.0}" width="{w}" height="{ht:.0}" role="img" aria-label="difference by layer and token position">"#);
    for (i, (layer, cells)) in h.layers.iter().zip(&h.cells).enumerate() {
        let y = TOP + i as f64 * ch;
        // A label every `k` rows, so labels 10 px high never overlap.
        let k = (11.0 / ch).ceil().max(1.0) as usize;
        if i % k == 0 {
            let _ = write!(o, r#"<text x="{}" y="{:.1}" class="tick">{}</text>"#, LEFT - 6.0, y + ch * 0.75, layer.html());
        }
        // One rect per column: the largest difference of its positions (NaN wins).
        let mut col: std::collections::BTreeMap<u32, (u32, f64)> = std::collections::BTreeMap::new();
        for &(p, d) in cells {
            let e = col.entry(p / per).or_insert((p, d));
            if d.is_nan() || (!e.1.is_nan() && d > e.1) {
                *e = (p, d);
            }
        }
        for (c, (p, d)) in col {
            let faded = if flip.is_some_and(|f| p >= f) { r#" opacity="0.35""# } else { "" };
            let what = if d.is_nan() {
                "NaN/Inf on one side".to_string()
            } else if d == 0.0 {
                "identical".to_string()
            } else if d <= f64::MIN_POSITIVE {
                "differs below the statistics' resolution".to_string()
            } else {
                format!("max |a-b| ≥ {}", g(d))
            };
            let at = if per > 1 { format!("positions {}..{}", c * per, (c + 1) * per - 1) } else { format!("position {p}") };
            let _ = write!(
                o,
                r#"<rect x="{:.1}" y="{y:.1}" width="{:.2}" height="{ch:.1}" fill="{}"{faded} class="cell"><title>{} {at}: {what}</title></rect>"#,
                x_of(c * per),
                cw,
                colour(d, lo, hi),
                layer.html()
            );
        }
    }
    marks(&mut o, h, r, (x_of, cw, ch), flip);
    axes(&mut o, (npos, per, cols), (cw, plot_h, w), (lo, hi));
    o.push_str("</svg>");
    o
}

/// The root cause's and the earliest difference's boxes, and the flip's line.
fn marks(o: &mut String, h: &Heat, r: &Report, (x_of, cw, ch): (impl Fn(u32) -> f64, f64, f64), flip: Option<u32>) {
    let row_of = |path: &str| h.layers.iter().position(|l| *l == layer_group(path));
    let mut boxed = |path: &str, pos: u32, class: &str, title: &str| {
        if let Some(i) = row_of(path) {
            let _ = write!(o, r#"<rect x="{:.1}" y="{:.1}" width="{:.2}" height="{ch:.1}" class="mark {class}"><title>{title}</title></rect>"#, x_of(pos), TOP + i as f64 * ch, cw.max(3.0));
        }
    };
    if let Some(d) = r.first_divergence.as_ref().filter(|d| d.row == h.row) {
        boxed(&d.path, d.position, "root", "the root cause: the first difference that reached its layer's output");
    }
    if let (Some(x), Some(d)) = (r.absorbed.first(), r.first_divergence.as_ref().filter(|d| d.row == h.row)) {
        if (x.path.as_str(), x.position) != (d.path.as_str(), d.position) {
            boxed(&x.path, x.position, "entry", "the earliest difference (it died out within its layer)");
        }
    }
    if let (Some(f), Some(t)) = (flip, r.first_token_divergence.as_ref()) {
        let x = x_of(f);
        let bottom = TOP + ch * h.layers.len() as f64;
        let _ = write!(
            o,
            r#"<line x1="{x:.1}" y1="{:.1}" x2="{x:.1}" y2="{bottom:.1}" class="mark flip"/><text x="{:.1}" y="{:.1}" class="flipnote">token {} flips</text>"#,
            TOP - 4.0,
            x - 3.0,
            TOP - 8.0,
            t.step
        );
    }
}

/// Position ticks, the axis titles and the colour legend.
fn axes(o: &mut String, (npos, per, cols): (u32, u32, u32), (cw, plot_h, w): (f64, f64, f64), (lo, hi): (f64, f64)) {
    let y = TOP + plot_h;
    let step = (npos / 10).max(1);
    for p in (0..npos).step_by(step as usize) {
        let _ = write!(o, r#"<text x="{:.1}" y="{:.1}" class="lab">{p}</text>"#, LEFT + (p / per) as f64 * cw, y + 14.0);
    }
    let _ = write!(o, r#"<text x="{:.1}" y="{:.1}" class="title">token position</text>"#, LEFT + cols as f64 * cw / 2.0, y + 36.0);
    let _ = write!(o, r#"<text x="12" y="{:.1}" class="title" transform="rotate(-90 12 {:.1})">layer</text>"#, TOP + plot_h / 2.0, TOP + plot_h / 2.0);
    // The legend: the colour of each power of ten, identical, NaN.
    let lx = w - 96.0;
    let _ = write!(o, r#"<text x="{lx}" y="{:.1}" class="lab">max |a-b|</text>"#, TOP - 8.0);
    let n = (hi - lo).max(1.0) as i32;
    for (k, e) in (lo as i32..=hi as i32).enumerate() {
        let yy = TOP + k as f64 * 14.0;
        let _ = write!(o, r#"<rect x="{lx}" y="{yy:.1}" width="12" height="12" fill="{}"/><text x="{}" y="{:.1}" class="lab">1e{e}</text>"#, colour(10f64.powi(e), lo, hi), lx + 16.0, yy + 10.0);
        if k as i32 > n {
            break;
        }
    }
    let yy = TOP + (n + 2) as f64 * 14.0;
    let _ = write!(
        o,
        r##"<rect x="{lx}" y="{yy:.1}" width="12" height="12" fill="#e3eee3"/><text x="{}" y="{:.1}" class="lab">identical</text><rect x="{lx}" y="{:.1}" width="12" height="12" fill="#6a1b9a"/><text x="{}" y="{:.1}" class="lab">NaN/Inf</text>"##,
        lx + 16.0,
        yy + 10.0,
        yy + 14.0,
        lx + 16.0,
        yy + 24.0
    );
}
