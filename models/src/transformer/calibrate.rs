//! Quantization state of a [`Model`]: the profile and its points, the shadow path per layer
//! (pruning by importance), and the offline passes that measure them (calibration, layer
//! importance, outlier counts per channel), which always run on the host executor.

use super::*;
use crate::logits::mean_nll;

impl Model {
    /// Use a calibrated profile for W8A8 prefill (it must belong to this model's weights): its
    /// clip ranges become the NPU inputs' quantization, its hot channels the INT8 columns each
    /// linear keeps contiguous for the CPU's shadow path (while the plan has one: llm.npu's
    /// stages; whole layers run their outliers in the graphs). Every shadow path is on; see
    /// [`Model::prune_shadow`].
    pub fn set_profile(&mut self, profile: QuantProfile) -> Result<()> {
        if profile.model_id != self.model_id {
            return Err(Error::Input(format!("quant profile was calibrated for model {}, this model is {}", profile.model_id, self.model_id)));
        }
        // All checked before anything changes: a bad profile leaves the model as it was.
        profile.validate().map_err(|why| Error::Input(format!("quant profile: {why}")))?;
        if !profile.importance.is_empty() && profile.importance.len() != self.layers.len() {
            return Err(Error::Input(format!("quant profile: importance of {} layers, the model has {}", profile.importance.len(), self.layers.len())));
        }
        for (l, layer) in self.layers.iter().enumerate() {
            for (s, lins) in layer.stages.iter().enumerate() {
                let name = point(l, STAGES[s].point);
                let (channels, k) = (profile.point(&name)?.channels, lins[0].dims().1);
                if channels != k {
                    return Err(Error::Input(format!("quant profile point {name} has {channels} channels, the model {k}")));
                }
            }
        }
        let mut a16 = Vec::with_capacity(self.layers.len());
        for l in 0..self.layers.len() {
            let mut row16 = [Quant::symmetric(1.0); N_STAGES];
            for (s, stage) in STAGES.iter().enumerate() {
                let p = profile.point(&point(l, stage.point))?;
                row16[s] = Quant::u16_range(p.min, p.max);
            }
            a16.push(row16);
        }
        self.graphs_mut().retain(|k, _| k.1 == Precision::F32);
        self.a16 = a16;
        self.profile = Some(profile);
        self.shadow_columns(self.sched.plan)?;
        self.points.clear();
        self.shadow_on.clear();
        self.set_shadow_layers(&vec![true; self.layers.len()])
    }

    /// Keeps each linear's hot columns (its profile's hot channels' INT8 columns, contiguous)
    /// while `plan` runs the shadow path on the CPU (llm.npu's stages), and drops them for whole
    /// layers, whose outliers run in the graphs: a speed structure of the CPU's outlier products
    /// (results are the same with any hot set), 58 MB on SmolLM2 and 270 MB on Qwen2.5-Coder
    /// (`docs/memory.md`) that a phone running whole layers would hold for nothing.
    pub(super) fn shadow_columns(&mut self, plan: PrefillPlan) -> Result<()> {
        let Some(profile) = &self.profile else { return Ok(()) };
        for (l, layer) in self.layers.iter_mut().enumerate() {
            for (s, lins) in layer.stages.iter_mut().enumerate() {
                let p = profile.point(&point(l, STAGES[s].point))?;
                for lin in lins.iter_mut() {
                    lin.set_hot(if plan == PrefillPlan::Stages { &p.hot } else { &[] })?;
                }
            }
        }
        Ok(())
    }

    /// Run the shadow path of the layers where `on[l]` and prune it elsewhere. A pruned layer's
    /// NPU inputs go back to their full calibrated range (min/max): with no shadow path to add
    /// the remainder back, the tight clip range would drop it (measured on SmolLM2: keeping the
    /// tight ranges and pruning half the layers raised perplexity 57x).
    pub fn set_shadow_layers(&mut self, on: &[bool]) -> Result<()> {
        if on.len() != self.layers.len() {
            return Err(Error::Input(format!("shadow mask of {} layers for a model of {}", on.len(), self.layers.len())));
        }
        for (layer, &on) in self.layers.iter_mut().zip(on) {
            layer.stages.iter_mut().flatten().for_each(|lin| lin.set_shadow(on));
        }
        let Some(profile) = &self.profile else {
            self.shadow_on = on.to_vec();
            return Ok(());
        };
        let mut changed = false;
        for (l, &on) in on.iter().enumerate() {
            if self.shadow_on.get(l) == Some(&on) && self.points.len() > l {
                continue;
            }
            let row = STAGES
                .iter()
                .map(|stage| {
                    let name = point(l, stage.point);
                    let p = profile.point(&name)?;
                    Ok(match on {
                        true => InputPoint::new(name, p.lo, p.hi, p.channels, &p.hot),
                        false => InputPoint::new(name, p.min, p.max, p.channels, &[]),
                    })
                })
                .collect::<Result<Vec<_>>>()?
                .try_into()
                .map_err(|_| Error::Internal("a point per stage".into()))?;
            match self.points.get_mut(l) {
                Some(r) => *r = row,
                None => self.points.push(row),
            }
            changed = true;
        }
        self.shadow_on = on.to_vec();
        if changed {
            // The NPU inputs' quantization is part of the stage graphs.
            self.graphs_mut().retain(|k, _| !matches!(k.1, Precision::W8A8 | Precision::W8A16Shadow));
        }
        Ok(())
    }

    /// Prune the shadow path of the `rate` share (0..=1) of layers with the lowest measured
    /// importance (from the profile); returns the layers kept.
    pub fn prune_shadow(&mut self, rate: f64) -> Result<Vec<bool>> {
        if !(0.0..=1.0).contains(&rate) {
            return Err(Error::Input(format!("pruning rate {rate} is not within 0..=1")));
        }
        let n = self.layers.len();
        let imp = match &self.profile {
            Some(p) if p.importance.len() == n => p.importance.clone(),
            _ if rate == 0.0 => vec![0.0; n],
            _ => return Err(Error::Input("pruning needs layer importance in the quant profile: measure it (Pipeline::ensure_profile does)".into())),
        };
        let pruned = (rate * n as f64).round() as usize;
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by(|&a, &b| imp[a].total_cmp(&imp[b]));
        let mut on = vec![true; n];
        order.iter().take(pruned).for_each(|&l| on[l] = false);
        self.set_shadow_layers(&on)?;
        Ok(on)
    }

    /// Outlier statistics of every quantization point since the profile was set (or reset).
    pub fn point_stats(&self) -> Vec<(String, PointStats)> {
        self.points.iter().flatten().map(|p| (p.name.clone(), p.stats())).collect()
    }

    /// The CPU time the shadow path took since the last call (its share of prefill time).
    pub fn take_shadow_time(&mut self) -> std::time::Duration {
        std::mem::take(self.shadow_time.get_mut().unwrap_or_else(|e| e.into_inner()))
    }

    /// Zeroes every quantization point's outlier counts (what [`Model::point_stats`] reports).
    pub fn reset_point_stats(&self) {
        self.points.iter().flatten().for_each(InputPoint::reset_stats);
    }

    /// Run `f` with the host executor as this model's device and fresh graphs, then restore both.
    /// Offline passes over NPU graphs (importance, outlier counting) always run here: the x86
    /// HTP emulator would take hours for them.
    pub(super) fn on_host<R>(&mut self, f: impl FnOnce(&mut Self) -> Result<R>) -> Result<R> {
        let device = std::mem::replace(&mut self.device, NpuDevice::host());
        let graphs = std::mem::take(self.graphs_mut());
        let r = f(self);
        self.device = device;
        *self.graphs_mut() = graphs;
        self.clear();
        r
    }

    /// Collect activation statistics over `sequences`: each runs through the layers on the CPU
    /// with the decode weights (float activations, the INT8 weights the NPU will hold), and
    /// every stage's input is observed. Not through float NPU graphs: those would hold an F32
    /// copy of every weight (600 MiB of the main job's peak for SmolLM2), and on an HTP they
    /// compute in FP16. `progress` is called after each sequence.
    pub fn calibrate(&mut self, sequences: &[Vec<u32>], mut progress: impl FnMut(usize)) -> Result<Calibrator> {
        let mut cal = Calibrator::default();
        for (i, tokens) in sequences.iter().enumerate() {
            let mut seq = self.sequence();
            self.run_cpu(&mut [(&mut seq, tokens)], Some(&mut cal), false)?;
            cal.tokens_seen += tokens.len();
            progress(i + 1);
        }
        Ok(cal)
    }

    /// Per layer, the increase of the mean negative log-likelihood (nats/token) over `sequences`
    /// when that layer's shadow path is pruned (its inputs back to min/max), all others on: what
    /// pruning it costs. Runs W8A8 prefill on the host executor (1 + layers passes); needs a
    /// profile, and stores the result in it (where [`Model::prune_shadow`] reads it).
    pub fn measure_importance(&mut self, sequences: &[Vec<u32>], chunk_len: usize, mut progress: impl FnMut(usize, usize)) -> Result<Vec<f32>> {
        let n = self.layers.len();
        let kept = self.shadow_on.clone();
        let r = self.on_host(|m| {
            let loss = |m: &mut Model, on: &[bool]| -> Result<f64> {
                m.set_shadow_layers(on)?;
                let mut total = 0.0;
                for tokens in sequences {
                    let logits = m.run_prefill(&mut m.sequence(), tokens, &m.npu_only_plan(tokens.len(), chunk_len)?, Precision::W8A8, true)?;
                    total += mean_nll(&logits, tokens)?;
                }
                Ok(total / sequences.len() as f64)
            };
            let base = loss(m, &vec![true; n])?;
            progress(1, n + 1);
            let mut imp = Vec::with_capacity(n);
            for l in 0..n {
                let mut on = vec![true; n];
                on[l] = false;
                imp.push((loss(m, &on)? - base) as f32);
                progress(l + 2, n + 1);
            }
            Ok(imp)
        });
        self.set_shadow_layers(&kept)?;
        let imp = r?;
        if let Some(p) = self.profile.as_mut() {
            p.importance = imp.clone();
        }
        Ok(imp)
    }

    /// Outliers per input channel of every point over `sequences` (W8A8 on the host, every
    /// shadow path on): what [`QuantProfile::select_hot`] chooses the hot set from.
    pub fn count_channel_outliers(&mut self, sequences: &[Vec<u32>], chunk_len: usize, mut progress: impl FnMut(usize)) -> Result<Vec<(String, Vec<u64>)>> {
        let kept = self.shadow_on.clone();
        self.set_shadow_layers(&vec![true; self.layers.len()])?;
        self.reset_point_stats();
        let r = self.on_host(|m| {
            for (i, tokens) in sequences.iter().enumerate() {
                m.run_prefill(&mut m.sequence(), tokens, &m.npu_only_plan(tokens.len(), chunk_len)?, Precision::W8A8, false)?;
                progress(i + 1);
            }
            Ok(m.points.iter().flatten().map(|p| (p.name.clone(), p.channel_outliers())).collect())
        });
        self.reset_point_stats();
        self.set_shadow_layers(&kept)?;
        r
    }
}
