//! [`LineRenderer`]: burn-train's metrics as short plain lines, for output that is not a
//! terminal (a log file, CI). burn-train 0.22.1 renders with its terminal dashboard when
//! stdout is a terminal and its `tui` feature is on; otherwise its fallback prints the `Debug`
//! form of its progress for every batch, several hundred lines an epoch.
//!
//! The rules:
//! - A line when the split's items cross a multiple of `every` items (and one when a split
//!   ends, with the split's values as burn-train logs them), never one per batch.
//! - The items are what the event processor reports as processed in the split: with
//!   [`crate::ShardedStrategy`] the sum over the ranks, each item counted once.
//! - The metric values are running means over the split so far, weighted as burn-train weights
//!   them (each update's count); at a split's end, burn-train's final value of the split.
//! - A summary when training ends: each epoch's values and the items per second.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::io::Write;
use std::time::Instant;

use burn::train::LearnerSummary;
use burn::train::logger::{EvaluationProgressLogger, TrainingProgressLogger};
use burn::train::metric::{MetricAttributes, MetricDefinition, MetricId, NumericEntry};
use burn::train::renderer::{
    EvaluationName, MetricState, MetricsRenderer, MetricsRendererEvaluation, MetricsRendererTraining,
};

/// burn-train's metrics as one short line every `every` items of a split, a line at each
/// split's end and a summary when training ends; for output that is not a terminal.
///
/// ```ignore
/// use std::io::IsTerminal;
/// let mut training = SupervisedTraining::new(dir, train, valid).metrics((LossMetric::new(), AccuracyMetric::new()));
/// if !std::io::stdout().is_terminal() {
///     // A line every 20 steps of 32 items: `train epoch 1/1  640/5452 items  Loss 0.9210  Accuracy 71.41 %  55.2 items/s`
///     training = training.renderer(Box::new(LineRenderer::new(20 * 32)));
/// }
/// ```
pub struct LineRenderer {
    out: Box<dyn Write + Send + Sync>,
    every: usize,
    /// The numeric metrics, in the order they were registered: name and unit.
    metrics: Vec<(MetricId, String, Option<String>)>,
    split: Option<SplitState>,
    epoch: usize,
    epochs: usize,
    /// One line per ended split, for the summary.
    ended: Vec<String>,
    /// Training items over the run, and when it started.
    train_items: usize,
    started: Instant,
    train_seconds: f64,
}

/// The split being rendered.
struct SplitState {
    name: String,
    total: usize,
    items: usize,
    next_line: usize,
    started: Instant,
    /// Per metric: the weighted sum and the weight of the split's updates so far, and its
    /// final value once burn-train computed it.
    values: HashMap<MetricId, (f64, f64, Option<f64>)>,
}

impl LineRenderer {
    /// A line every `every` items of a split (at least 1), to stdout. For a line every `n`
    /// steps, `every = n ×` the global batch (the loader's batch size times the world size).
    pub fn new(every: usize) -> Self {
        Self::to(every, std::io::stdout())
    }

    /// As [`LineRenderer::new`], writing to `out` (a file, a buffer).
    pub fn to(every: usize, out: impl Write + Send + Sync + 'static) -> Self {
        Self {
            out: Box::new(out),
            every: every.max(1),
            metrics: Vec::new(),
            split: None,
            epoch: 1,
            epochs: 0,
            ended: Vec::new(),
            train_items: 0,
            started: Instant::now(),
            train_seconds: 0.0,
        }
    }

    fn write(&mut self, line: &str) {
        // A renderer has nowhere to report a failed write; the training goes on.
        let _ = writeln!(self.out, "{line}");
        let _ = self.out.flush();
    }

    fn numeric(&mut self, state: MetricState) {
        let (MetricState::Numeric(entry, Some(value)), Some(split)) = (state, self.split.as_mut()) else {
            return;
        };
        let slot = split.values.entry(entry.metric_id).or_insert((0.0, 0.0, None));
        match value {
            NumericEntry::Value(v) => {
                slot.0 += v;
                slot.1 += 1.0;
            }
            NumericEntry::Aggregated {
                aggregated_value,
                count,
            } => {
                slot.0 += aggregated_value * count as f64;
                slot.1 += count as f64;
            }
            NumericEntry::Final(v) => slot.2 = Some(v),
        }
    }

    /// `train epoch 1/3  640/5452 items  Loss 0.9210  Accuracy 71.41 %  55.2 items/s`
    fn line(&self, split: &SplitState) -> String {
        let mut line = format!(
            "{} epoch {}/{}  {}/{} items",
            split.name, self.epoch, self.epochs, split.items, split.total
        );
        self.push_values(&mut line, split);
        let seconds = split.started.elapsed().as_secs_f64();
        if seconds > 0.0 {
            let _ = write!(line, "  {:.1} items/s", split.items as f64 / seconds);
        }
        line
    }

    fn push_values(&self, line: &mut String, split: &SplitState) {
        for (id, name, unit) in &self.metrics {
            let Some((sum, weight, last)) = split.values.get(id) else {
                continue;
            };
            let value = match last {
                Some(v) => *v,
                None if *weight > 0.0 => sum / weight,
                None => continue,
            };
            let _ = match unit {
                Some(unit) => write!(line, "  {name} {value:.2} {unit}"),
                None => write!(line, "  {name} {value:.4}"),
            };
        }
    }
}

impl MetricsRendererTraining for LineRenderer {
    fn update_train(&mut self, state: MetricState) {
        self.numeric(state);
    }

    fn update_valid(&mut self, state: MetricState) {
        self.numeric(state);
    }

    fn on_train_end(&mut self, _summary: Option<LearnerSummary>) -> Result<(), Box<dyn core::error::Error>> {
        // burn-train's summary prints the whole model's structure first; the values are the
        // ones of the split lines, so the summary is those lines.
        let seconds = self.started.elapsed().as_secs_f64();
        let mut head = format!("summary: {} training items in {seconds:.1} s", self.train_items);
        if self.train_seconds > 0.0 {
            let _ = write!(
                head,
                " ({:.1} items/s while training)",
                self.train_items as f64 / self.train_seconds
            );
        }
        self.write(&head);
        for line in std::mem::take(&mut self.ended) {
            self.write(&format!("  {line}"));
        }
        Ok(())
    }
}

impl TrainingProgressLogger for LineRenderer {
    fn start(&mut self, total_epochs: usize, starting_epoch: usize, _total_items: Option<usize>, label: Option<&str>) {
        self.epochs = total_epochs;
        self.epoch = starting_epoch.max(1);
        self.started = Instant::now();
        let label = label.map_or(String::new(), |l| format!("{l}: "));
        self.write(&format!(
            "{label}training epochs {}..={total_epochs}, a line every {} items",
            self.epoch, self.every
        ));
    }

    fn update_epoch(&mut self, epoch: usize) {
        self.epoch = epoch + 1;
    }

    fn start_split(&mut self, split: &str, total_items: usize) {
        self.split = Some(SplitState {
            name: split.to_string(),
            total: total_items,
            items: 0,
            next_line: self.every,
            started: Instant::now(),
            values: HashMap::new(),
        });
    }

    fn update_split(&mut self, items_processed: usize) {
        let Some(mut split) = self.split.take() else { return };
        split.items = items_processed;
        if items_processed >= split.next_line && items_processed < split.total {
            split.next_line = (items_processed / self.every + 1) * self.every;
            let line = self.line(&split);
            self.write(&line);
        }
        self.split = Some(split);
    }

    fn end_split(&mut self) {
        let Some(split) = self.split.take() else { return };
        let line = self.line(&split);
        self.write(&line);
        if split.name == "train" {
            self.train_items += split.items;
            self.train_seconds += split.started.elapsed().as_secs_f64();
        }
        let mut ended = format!("{} epoch {}: {} items", split.name, self.epoch, split.items);
        self.push_values(&mut ended, &split);
        self.ended.push(ended);
    }

    fn end(&mut self) {}

    fn log_event_training(&mut self, _event: String) {}
}

impl MetricsRendererEvaluation for LineRenderer {
    fn update_test(&mut self, _name: EvaluationName, state: MetricState) {
        self.numeric(state);
    }

    fn on_test_end(&mut self, _summary: Option<LearnerSummary>) -> Result<(), Box<dyn core::error::Error>> {
        for line in std::mem::take(&mut self.ended) {
            self.write(&format!("  {line}"));
        }
        Ok(())
    }
}

impl EvaluationProgressLogger for LineRenderer {
    fn start_global_progress(&mut self, _total_tests: usize) {
        self.epochs = 1;
        self.epoch = 1;
    }

    fn start_test(&mut self, name: &str, total_items: usize) {
        TrainingProgressLogger::start_split(self, name, total_items);
    }

    fn update_test_progress(&mut self, items_processed: usize) {
        TrainingProgressLogger::update_split(self, items_processed);
    }

    fn end_test(&mut self) {
        TrainingProgressLogger::end_split(self);
    }

    fn end_global_progress(&mut self) {}

    fn log_event_evaluation(&mut self, _event: String) {}
}

impl MetricsRenderer for LineRenderer {
    fn manual_close(&mut self) {}

    fn register_metric(&mut self, definition: MetricDefinition) {
        if self.metrics.iter().any(|(id, ..)| *id == definition.metric_id) {
            return;
        }
        let unit = match definition.attributes {
            MetricAttributes::Numeric(attributes) => attributes.unit,
            MetricAttributes::None => None,
        };
        self.metrics
            .push((definition.metric_id, definition.name.to_string(), unit));
    }
}
