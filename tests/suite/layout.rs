//! The flat layout: order, padding, ownership, frozen and odd-sized parameters.

use burn::module::{Module, Param};
use burn::optim::AdamConfig;
use burn::prelude::*;
use burn_shard::{FlatLayout, ShardConfig, ShardError, Stage};
use burn_shard_comm::{Collective, InProcessGroup, run_ranks};

use crate::common::TinyMlp;

#[test]
fn slots_follow_module_order_and_buckets_are_padded() {
    let device = Device::flex().autodiff();
    let model = TinyMlp::new(&device);
    for world_size in 1..=5 {
        let layout = FlatLayout::from_module(&model, world_size, usize::MAX).unwrap();
        let paths: Vec<_> = layout.slots().iter().map(|s| s.path.as_str()).collect();
        assert_eq!(paths, ["l1.weight", "l1.bias", "l2.weight", "l2.bias", "scale"]);
        assert_eq!(layout.numel(), 5 * 7 + 7 + 7 * 3 + 3 + 1);
        let b = &layout.buckets()[0];
        assert_eq!(b.padded_numel % world_size, 0);
        assert!(b.padded_numel - b.numel < world_size);
        // Offsets are contiguous and the shards tile the padded bucket.
        let mut off = 0;
        for s in layout.slots() {
            assert_eq!(s.offset, off);
            off += s.numel;
        }
        let tiled: usize = (0..world_size).map(|r| b.shard_range(r).len()).sum();
        assert_eq!(tiled, b.padded_numel);
        assert_eq!(b.shard_range(world_size - 1).end, b.padded_numel);
    }
}

#[test]
fn small_buckets_never_split_a_parameter() {
    let device = Device::flex().autodiff();
    let layout = FlatLayout::from_module(&TinyMlp::new(&device), 3, 10).unwrap();
    for s in layout.slots() {
        let b = &layout.buckets()[s.bucket];
        assert!(s.offset + s.numel <= b.numel, "{} straddles its bucket", s.path);
    }
    // l1.weight (35) exceeds 10 and gets its own bucket.
    assert_eq!(layout.buckets()[0].numel, 35);
}

#[derive(Module, Debug)]
struct WithFrozen {
    trained: Param<Tensor<2>>,
    frozen: Param<Tensor<1>>,
    empty: Param<Tensor<1>>,
}

#[test]
fn frozen_and_empty_parameters_are_left_out() {
    let device = Device::flex().autodiff();
    let m = WithFrozen {
        trained: Param::from_tensor(Tensor::ones([2, 3], &device).require_grad()),
        frozen: Param::from_tensor(Tensor::ones([4], &device)).set_require_grad(false),
        empty: Param::from_tensor(Tensor::<1>::zeros([0], &device).require_grad()),
    };
    let layout = FlatLayout::from_module(&m, 4, usize::MAX).unwrap();
    let paths: Vec<_> = layout.slots().iter().map(|s| s.path.as_str()).collect();
    assert_eq!(paths, ["trained"]);
    assert_eq!(layout.numel(), 6);
    assert_eq!(layout.buckets()[0].padded_numel, 8);
    assert_eq!(layout.padding(), 2);
}

#[test]
fn a_model_without_trainable_parameters_has_an_empty_layout() {
    // A frozen teacher or an evaluation-only model: nothing to train, nothing to refuse.
    let device = Device::flex().autodiff();
    let layout = FlatLayout::from_module(&TinyMlp::new(&device).no_grad(), 2, 100).unwrap();
    assert!(layout.slots().is_empty() && layout.buckets().is_empty());
    assert_eq!((layout.numel(), layout.shard_numel()), (0, 0));
}

#[test]
fn ranks_with_different_models_get_a_layout_mismatch() {
    let results = run_ranks(InProcessGroup::new(2).unwrap(), |comm| {
        let device = Device::flex().autodiff();
        let rank = comm.rank();
        let m = WithFrozen {
            trained: Param::from_tensor(Tensor::ones([2, 3 + rank], &device).require_grad()),
            frozen: Param::from_tensor(Tensor::ones([4], &device)).set_require_grad(false),
            empty: Param::from_tensor(Tensor::<1>::zeros([0], &device).require_grad()),
        };
        ShardConfig::new(Stage::One)
            .init(m, AdamConfig::new().build(), comm)
            .err()
    })
    .unwrap();
    for (rank, err) in results.into_iter().enumerate() {
        let err = err.unwrap_or_else(|| panic!("rank {rank} must fail"));
        assert!(matches!(err, ShardError::LayoutMismatch { .. }), "rank {rank}: {err}");
        assert!(err.to_string().contains("same model"));
    }
}

#[test]
fn empty_frozen_and_scalar_parameters_train_at_every_stage() {
    for stage in [Stage::Zero, Stage::One, Stage::Two, Stage::Three] {
        let out = run_ranks(InProcessGroup::new(3).unwrap(), |comm| {
            let device = Device::flex().autodiff();
            let rank = comm.rank() as f32;
            // Frozen values differ per rank: init must make them rank 0's.
            let m = WithFrozen {
                trained: Param::from_tensor(Tensor::ones([2, 3], &device).require_grad()),
                frozen: Param::from_tensor(Tensor::ones([4], &device).add_scalar(rank)).set_require_grad(false),
                empty: Param::from_tensor(Tensor::<1>::zeros([0], &device).require_grad()),
            };
            let (mut m, mut optim) = ShardConfig::new(stage)
                .init(m, AdamConfig::new().build(), comm)
                .unwrap();
            for _ in 0..3 {
                let loss = (m.trained.val().sum() * m.frozen.val().sum()).add(m.empty.val().sum());
                let grads = burn::optim::GradientsParams::from_grads(loss.backward(), &m);
                m = optim.step(0.1, m, grads).unwrap();
            }
            let m = m.materialize();
            (
                m.trained
                    .val()
                    .into_data()
                    .convert::<f32>()
                    .iter::<f32>()
                    .collect::<Vec<_>>(),
                m.frozen
                    .val()
                    .into_data()
                    .convert::<f32>()
                    .iter::<f32>()
                    .collect::<Vec<_>>(),
                m.empty.val().dims(),
            )
        })
        .unwrap();
        for (rank, (trained, frozen, empty)) in out.iter().enumerate() {
            assert_eq!(
                frozen,
                &vec![1.0; 4],
                "stage {stage} rank {rank}: frozen = rank 0's, untouched"
            );
            assert_eq!(
                empty,
                &[0],
                "stage {stage} rank {rank}: the empty parameter stays empty"
            );
            // Adam moves each element by about lr per step against the gradient (+frozen sum).
            assert!(
                trained.iter().all(|&v| (v - (1.0 - 0.3)).abs() < 1e-3),
                "stage {stage}: {trained:?}"
            );
        }
    }
}

#[derive(Module, Debug)]
struct Tied {
    a: Param<Tensor<1>>,
    b: Param<Tensor<1>>,
}

#[test]
fn a_parameter_cloned_into_two_fields_is_a_clear_error() {
    let device = Device::flex().autodiff();
    let p = Param::from_tensor(Tensor::<1>::ones([3], &device).require_grad());
    let err = FlatLayout::from_module(&Tied { a: p.clone(), b: p }, 2, 100).unwrap_err();
    assert!(matches!(err, ShardError::DuplicateParam { .. }), "{err}");
    assert!(
        err.to_string().contains("`a`") && err.to_string().contains("`b`"),
        "{err}"
    );
}

#[test]
fn a_rank_that_fails_alone_in_step_releases_the_others() {
    let start = std::time::Instant::now();
    let group = InProcessGroup::new(2)
        .unwrap()
        .with_timeout(std::time::Duration::from_secs(120));
    let out = run_ranks(group, |comm| {
        let device = Device::flex().autodiff();
        let rank = comm.rank();
        let model = TinyMlp::new(&device);
        let (model, mut optim) = ShardConfig::new(Stage::Two)
            .init(model, AdamConfig::new().build(), comm)
            .unwrap();
        // Rank 1 passes a model the optimizer has never seen.
        let model = if rank == 1 { TinyMlp::new(&device) } else { model };
        let loss = model.forward(Tensor::ones([2, crate::common::IN], &device)).sum();
        let grads = burn::optim::GradientsParams::from_grads(loss.backward(), &model);
        optim.step(1e-3, model, grads).err()
    })
    .unwrap();
    assert!(matches!(out[1], Some(ShardError::UnknownParam { .. })), "{:?}", out[1]);
    assert!(out[0].is_some(), "rank 0 must fail too");
    assert!(
        start.elapsed() < std::time::Duration::from_secs(30),
        "took {:?}",
        start.elapsed()
    );
}
