//! What a run measured, step by step: one CSV row per measurement (`csv`) and a PNG plot of the
//! loss curves (`plotters`).

use std::path::Path;
use std::time::Instant;

use plotters::prelude::*;
use serde::{Deserialize, Serialize};

/// The font the plots are drawn with: DejaVu Sans Mono, shipped next to this crate with its
/// licence (`examples/assets/DejaVu-LICENSE.txt`), so a machine without fonts draws them too.
static FONT: &[u8] = include_bytes!("../assets/DejaVuSansMono.ttf");

/// One measurement: the training loss of a step, a validation estimate, or both. Losses are
/// mean cross-entropies in nats per token (per sentence for classifiers); accuracy is in
/// `[0, 1]`. Empty cells in the CSV are measurements not taken at that step.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Row {
    /// Optimizer steps done (1-based; 0 = before training).
    pub step: usize,
    /// Mean over the ranks of their losses of this step.
    pub train_loss: Option<f32>,
    /// Mean loss over the validation set.
    pub val_loss: Option<f32>,
    /// Share of the validation set classified right (classifiers only).
    pub val_accuracy: Option<f32>,
    /// Wall-clock seconds of training up to the end of this step (rank 0's clock, from when
    /// the run's metrics were set up; a resumed run continues from the last time its
    /// predecessor recorded, so the time between the two runs is left out): step times are
    /// differences of it. Empty in CSVs written before this column existed.
    #[serde(default)]
    pub seconds: Option<f64>,
}

/// The rows of a run, in step order.
#[derive(Default, Debug, Clone)]
pub struct Metrics {
    /// Every measurement so far.
    pub rows: Vec<Row>,
    /// When this process's training started: at [`Metrics::earlier`], else at the first
    /// [`Metrics::train`].
    started: Option<Instant>,
    /// Seconds an earlier run recorded before this one resumed (its last `seconds`).
    offset: f64,
}

impl Metrics {
    /// The rows of an earlier run's `dir/metrics.csv` up to step `step` (a run resumed at
    /// `step` continues its curves), or none when there is no such file or `step` is 0 (a
    /// fresh run).
    ///
    /// # Errors
    /// The file exists but is not a metrics CSV.
    pub fn earlier(dir: &Path, step: usize) -> Result<Self, String> {
        let path = dir.join("metrics.csv");
        let started = Some(Instant::now());
        if step == 0 || !path.is_file() {
            return Ok(Self {
                rows: Vec::new(),
                started,
                offset: 0.0,
            });
        }
        let mut reader = csv::Reader::from_path(&path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        let rows = reader
            .deserialize::<Row>()
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("{} is not a metrics CSV: {e}", path.display()))?;
        let rows: Vec<Row> = rows.into_iter().filter(|r| r.step <= step).collect();
        let offset = rows.iter().rev().find_map(|r| r.seconds).unwrap_or(0.0);
        Ok(Self { rows, started, offset })
    }

    /// Records the training loss of step `step`, at the end of the step (the row's `seconds`).
    pub fn train(&mut self, step: usize, loss: f32) {
        let started = *self.started.get_or_insert_with(Instant::now);
        self.rows.push(Row {
            step,
            train_loss: Some(loss),
            val_loss: None,
            val_accuracy: None,
            seconds: Some(self.offset + started.elapsed().as_secs_f64()),
        });
    }

    /// Records a validation estimate after `step` steps (merged into that step's row).
    pub fn val(&mut self, step: usize, loss: f32, accuracy: Option<f32>) {
        match self.rows.last_mut() {
            Some(row) if row.step == step => {
                row.val_loss = Some(loss);
                row.val_accuracy = accuracy;
            }
            _ => self.rows.push(Row {
                step,
                train_loss: None,
                val_loss: Some(loss),
                val_accuracy: accuracy,
                seconds: None,
            }),
        }
    }

    /// Writes `metrics.csv` and `losses.png` into `dir` (created if needed); returns their paths.
    ///
    /// # Errors
    /// The directory or a file cannot be written, or the plot cannot be drawn.
    pub fn write(&self, dir: &Path, title: &str) -> Result<[std::path::PathBuf; 2], String> {
        std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        let csv_path = dir.join("metrics.csv");
        let png_path = dir.join("losses.png");
        self.write_csv(&csv_path)
            .map_err(|e| format!("cannot write {}: {e}", csv_path.display()))?;
        self.plot(&png_path, title)
            .map_err(|e| format!("cannot draw {}: {e}", png_path.display()))?;
        Ok([csv_path, png_path])
    }

    fn write_csv(&self, path: &Path) -> Result<(), csv::Error> {
        let mut writer = csv::Writer::from_path(path)?;
        for row in &self.rows {
            writer.serialize(row)?;
        }
        writer.flush()?;
        Ok(())
    }

    /// Training loss (a line) and validation loss (a line with dots) against the step.
    fn plot(&self, path: &Path, title: &str) -> Result<(), Box<dyn std::error::Error>> {
        static REGISTER: std::sync::Once = std::sync::Once::new();
        REGISTER.call_once(|| {
            assert!(
                plotters::style::register_font("sans-serif", FontStyle::Normal, FONT).is_ok(),
                "the shipped font is a valid TrueType file"
            );
        });
        let train: Vec<(f32, f32)> = self
            .rows
            .iter()
            .filter_map(|r| Some((r.step as f32, r.train_loss?)))
            .collect();
        let val: Vec<(f32, f32)> = self
            .rows
            .iter()
            .filter_map(|r| Some((r.step as f32, r.val_loss?)))
            .collect();
        let all = || train.iter().chain(&val);
        let x_max = all().map(|p| p.0).fold(1.0f32, f32::max);
        let x_min = all().map(|p| p.0).fold(x_max, f32::min).min(x_max - 1.0);
        let finite = || all().map(|p| p.1).filter(|v| v.is_finite());
        let y_max = finite().fold(f32::MIN, f32::max).max(1e-3);
        let y_min = finite().fold(y_max, f32::min).min(y_max * 0.9);
        let pad = (y_max - y_min) * 0.05;

        let root = BitMapBackend::new(path, (900, 540)).into_drawing_area();
        root.fill(&WHITE)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(x_min..x_max, (y_min - pad).max(0.0)..y_max + pad)?;
        chart
            .configure_mesh()
            .x_desc("step")
            .x_label_formatter(&|x| format!("{}", x.round() as i64))
            .y_desc("loss (nats)")
            .label_style(("sans-serif", 14))
            .draw()?;
        chart
            .draw_series(LineSeries::new(train.iter().copied(), BLUE.mix(0.6)))?
            .label("train (mean over ranks)")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLUE));
        chart
            .draw_series(LineSeries::new(val.iter().copied(), RED.stroke_width(2)))?
            .label("validation")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], RED));
        chart.draw_series(val.iter().map(|&p| Circle::new(p, 3, RED.filled())))?;
        chart
            .configure_series_labels()
            .label_font(("sans-serif", 14))
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()?;
        root.present()?;
        Ok(())
    }
}
