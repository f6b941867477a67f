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
fn frozen_parameters_are_left_out_and_empty_ones_take_no_space() {
    let device = Device::flex().autodiff();
    let m = WithFrozen {
        trained: Param::from_tensor(Tensor::ones([2, 3], &device).require_grad()),
        frozen: Param::from_tensor(Tensor::ones([4], &device)).set_require_grad(false),
        empty: Param::from_tensor(Tensor::<1>::zeros([0], &device).require_grad()),
    };
    let layout = FlatLayout::from_module(&m, 4, usize::MAX).unwrap();
    let paths: Vec<_> = layout.slots().iter().map(|s| s.path.as_str()).collect();
    assert_eq!(paths, ["trained", "empty"]);
    assert_eq!(layout.numel(), 6);
    assert_eq!(layout.buckets()[0].padded_numel, 8);
    assert_eq!(layout.padding(), 2);
}

#[test]
fn a_model_without_trainable_parameters_is_a_clear_error() {
    let device = Device::flex().autodiff();
    let err = FlatLayout::from_module(&TinyMlp::new(&device).no_grad(), 2, 100).unwrap_err();
    assert!(matches!(err, ShardError::NoTrainableParams), "{err}");
    assert!(err.to_string().contains("autodiff"));
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
