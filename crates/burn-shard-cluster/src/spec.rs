//! [`ClusterSpec`] and [`LinkShape`]: the nodes and their links.

/// How every node's link to the bridge is shaped, the same in both directions.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LinkShape {
    /// Rate limit in Mbit/s (10^6 bits per second), by `tc`'s token bucket (`tbf`); `None`:
    /// as fast as the host moves packets between namespaces.
    pub rate_mbit: Option<f64>,
    /// Delay added to what a node sends, in milliseconds (`netem`; 0: none): the one-way
    /// delay between two nodes, a round trip twice it.
    pub delay_ms: f64,
    /// Jitter of that delay in milliseconds (`netem`; 0: none); it reorders packets.
    pub jitter_ms: f64,
    /// Packets a node sends that are lost, in percent (`netem`; 0: none).
    pub loss_percent: f64,
}

impl LinkShape {
    /// Whether this shape needs the `netem` qdisc (delay, jitter or loss).
    pub fn needs_netem(&self) -> bool {
        self.delay_ms > 0.0 || self.jitter_ms > 0.0 || self.loss_percent > 0.0
    }
}

/// A cluster: `nodes` network namespaces on one bridge, each link shaped as `link` says.
#[derive(Clone, Debug, PartialEq)]
pub struct ClusterSpec {
    /// Number of nodes, 1 to 200 (node `i` has address `10.77.0.(i+1)`).
    pub nodes: usize,
    /// Every node's link.
    pub link: LinkShape,
}

impl ClusterSpec {
    /// `nodes` nodes with unshaped links.
    pub fn new(nodes: usize) -> Self {
        Self {
            nodes,
            link: LinkShape::default(),
        }
    }

    /// Every link limited to `rate_mbit` Mbit/s.
    pub fn with_rate_mbit(mut self, rate_mbit: f64) -> Self {
        self.link.rate_mbit = Some(rate_mbit);
        self
    }

    /// Every link with `delay_ms` of one-way delay and `jitter_ms` of jitter (needs `netem`).
    pub fn with_delay_ms(mut self, delay_ms: f64, jitter_ms: f64) -> Self {
        self.link.delay_ms = delay_ms;
        self.link.jitter_ms = jitter_ms;
        self
    }

    /// Every link losing `loss_percent` percent of its packets (needs `netem`).
    pub fn with_loss_percent(mut self, loss_percent: f64) -> Self {
        self.link.loss_percent = loss_percent;
        self
    }
}
