//! The moving average corral keeps of every measure it learns from replies.

/// A moving average that starts at its first sample.
#[derive(Clone, Copy, Debug, Default)]
pub struct Ewma {
    value: Option<f64>,
}

impl Ewma {
    /// Weight of a new sample: about the last ten samples matter.
    const ALPHA: f64 = 0.2;

    pub fn record(&mut self, sample: f64) {
        if !sample.is_finite() {
            return;
        }
        self.value = Some(match self.value {
            Some(v) => v + Self::ALPHA * (sample - v),
            None => sample,
        });
    }

    pub fn get(&self) -> Option<f64> {
        self.value
    }

    /// Takes `value` (another replica's measure) where nothing was measured here yet.
    pub fn seed(&mut self, value: Option<f64>) {
        if self.value.is_none() {
            self.value = value.filter(|v| v.is_finite());
        }
    }
}
