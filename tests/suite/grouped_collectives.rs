//! The grouped collectives (`all_gather_many`, `reduce_scatter_many`) against their
//! single-tensor loops: same values, same dtypes, same traffic counted; and on GPUs (feature
//! `cuda`) through NCCL ranks that join from their environment.

use burn::prelude::*;
use burn::tensor::DType;
use burn_shard_comm::{Collective, CollectiveKind, CommError, InProcessGroup, ReduceOp, run_ranks};

use crate::common::Rng;

fn tensor(values: Vec<f32>) -> Tensor<1> {
    let n = values.len();
    Tensor::from_data(TensorData::new(values, [n]), &Device::flex())
}

fn host(t: Tensor<1>) -> Vec<u32> {
    t.into_data().convert::<f32>().iter::<f32>().map(f32::to_bits).collect()
}

/// A bucket of tensors of this rank: lengths divisible by `world_size`, one of them bf16.
fn bucket(rank: usize, world_size: usize, seed: u64) -> Vec<Tensor<1>> {
    [3, 1, 7, 2]
        .iter()
        .enumerate()
        .map(|(i, &k)| {
            let t = tensor(Rng::new(seed + 10 * rank as u64 + i as u64).vec(k * world_size));
            if i == 2 { t.cast(DType::BF16) } else { t }
        })
        .collect()
}

#[test]
fn grouped_collectives_equal_their_single_tensor_loops() {
    for world_size in 1..=4 {
        let out = run_ranks(InProcessGroup::new(world_size).unwrap(), |comm| {
            let r = comm.rank();
            let dtypes: Vec<DType> = bucket(r, world_size, 1).iter().map(|t| t.dtype()).collect();
            let before = comm.stats();
            let gathered = comm.all_gather_many(bucket(r, world_size, 1)).unwrap();
            let grouped_stats = comm.stats().since(&before);
            let before = comm.stats();
            let looped: Vec<_> = bucket(r, world_size, 1)
                .into_iter()
                .map(|t| comm.all_gather(t).unwrap())
                .collect();
            let loop_stats = comm.stats().since(&before);
            // Traffic only: the time counters differ from run to run.
            let traffic = |s: &burn_shard_comm::CommStats| {
                [
                    CollectiveKind::AllReduce,
                    CollectiveKind::ReduceScatter,
                    CollectiveKind::AllGather,
                    CollectiveKind::Broadcast,
                    CollectiveKind::Barrier,
                ]
                .map(|k| s.get(k))
            };
            assert_eq!(
                traffic(&grouped_stats),
                traffic(&loop_stats),
                "all_gather_many counts one call per tensor"
            );
            assert_eq!(grouped_stats.get(CollectiveKind::AllGather).calls, 4);
            let out_dtypes: Vec<DType> = gathered.iter().map(|t| t.dtype()).collect();
            assert_eq!(out_dtypes, dtypes, "dtypes are kept");

            let mut reduced = Vec::new();
            for op in [ReduceOp::Sum, ReduceOp::Avg] {
                let many = comm.reduce_scatter_many(bucket(r, world_size, 2), op).unwrap();
                let single: Vec<_> = bucket(r, world_size, 2)
                    .into_iter()
                    .map(|t| comm.reduce_scatter(t, op).unwrap())
                    .collect();
                reduced.push((
                    many.into_iter().map(host).collect::<Vec<_>>(),
                    single.into_iter().map(host).collect::<Vec<_>>(),
                ));
            }
            assert!(comm.all_gather_many(Vec::new()).unwrap().is_empty());
            assert!(comm.reduce_scatter_many(Vec::new(), ReduceOp::Sum).unwrap().is_empty());
            let gathered: Vec<_> = gathered.into_iter().map(host).collect();
            let looped: Vec<_> = looped.into_iter().map(host).collect();
            (gathered, looped, reduced)
        })
        .unwrap();
        for (rank, (gathered, looped, reduced)) in out.into_iter().enumerate() {
            let ctx = format!("world_size {world_size} rank {rank}");
            assert_eq!(gathered, looped, "{ctx}: all_gather_many");
            let lens: Vec<usize> = gathered.iter().map(Vec::len).collect();
            assert_eq!(
                lens,
                vec![
                    3 * world_size * world_size,
                    world_size * world_size,
                    7 * world_size * world_size,
                    2 * world_size * world_size
                ],
                "{ctx}"
            );
            for (many, single) in reduced {
                assert_eq!(many, single, "{ctx}: reduce_scatter_many");
                let lens: Vec<usize> = many.iter().map(Vec::len).collect();
                assert_eq!(lens, vec![3, 1, 7, 2], "{ctx}");
            }
        }
    }
}

#[test]
fn grouped_reduce_scatter_of_an_indivisible_tensor_is_an_error() {
    let out = run_ranks(InProcessGroup::new(2).unwrap(), |comm| {
        comm.reduce_scatter_many(vec![tensor(vec![1.0; 4]), tensor(vec![1.0; 3])], ReduceOp::Sum)
            .err()
    })
    .unwrap();
    for err in out {
        assert!(
            matches!(
                err,
                Some(CommError::NotDivisible {
                    len: 3,
                    world_size: 2,
                    ..
                })
            ),
            "{err:?}"
        );
    }
}

/// The NCCL side (feature `cuda`), run on every GPU by `cargo xtask multi-gpu-test` (its
/// `gpu::` filter selects this module): ranks as threads join one communicator through
/// `NcclComm::from_rendezvous_env`, as processes started by `burn-shard-run` do, and the
/// grouped collectives (one NCCL group) match the single calls.
#[cfg(feature = "cuda")]
mod gpu {
    use super::*;
    use burn_shard_comm::{NcclComm, RendezvousEnv};

    use crate::gpu::{gpus, host as values};
    use crate::job_fixtures::{SECOND, free_port, job_vars};

    #[test]
    fn gpu_ranks_join_from_their_environment_and_grouped_calls_match_single_ones() {
        let n = gpus();
        if n == 0 {
            return;
        }
        let port = free_port();
        let out = std::thread::scope(|s| {
            let handles: Vec<_> = (0..n)
                .map(|rank| {
                    s.spawn(move || {
                        let env = RendezvousEnv::from_vars(job_vars(rank, n, port)).unwrap();
                        let comm = NcclComm::from_rendezvous_env(&env, 60 * SECOND).expect("NCCL from the environment");
                        assert_eq!((comm.rank(), comm.world_size()), (rank, n));
                        let device = comm.device().clone();
                        let bucket = |seed: u64| -> Vec<Tensor<1>> {
                            [3usize, 1, 7]
                                .iter()
                                .enumerate()
                                .map(|(i, &k)| {
                                    let v = Rng::new(seed + 10 * rank as u64 + i as u64).vec(k * n);
                                    Tensor::from_data(TensorData::new(v, [k * n]), &device)
                                })
                                .collect()
                        };
                        let many: Vec<_> = comm
                            .all_gather_many(bucket(1))
                            .unwrap()
                            .into_iter()
                            .map(values)
                            .collect();
                        let single: Vec<_> = bucket(1)
                            .into_iter()
                            .map(|t| values(comm.all_gather(t).unwrap()))
                            .collect();
                        let rs_many: Vec<_> = comm
                            .reduce_scatter_many(bucket(2), ReduceOp::Avg)
                            .unwrap()
                            .into_iter()
                            .map(values)
                            .collect();
                        let rs_single: Vec<_> = bucket(2)
                            .into_iter()
                            .map(|t| values(comm.reduce_scatter(t, ReduceOp::Avg).unwrap()))
                            .collect();
                        assert_eq!(comm.stats().get(CollectiveKind::AllGather).calls, 6);
                        (many, single, rs_many, rs_single)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect::<Vec<_>>()
        });
        for (rank, (many, single, rs_many, rs_single)) in out.into_iter().enumerate() {
            assert_eq!(many, single, "all_gather_many rank {rank}");
            for (a, b) in rs_many.iter().flatten().zip(rs_single.iter().flatten()) {
                assert!(
                    (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
                    "reduce_scatter_many rank {rank}: {a} vs {b}"
                );
            }
            let lens: Vec<usize> = rs_many.iter().map(Vec::len).collect();
            assert_eq!(lens, vec![3, 1, 7], "rank {rank}");
        }
    }
}
