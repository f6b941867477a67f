//! `burn-shard-run --nproc-per-node N [--nnodes M|MIN:MAX --node-rank K --master-addr A --master-port P --job-token-file F] [--max-restarts R] -- program args...`, or `burn-shard-run --supervise --max-restarts R -- mpirun ...`

use std::process::ExitCode;

fn main() -> ExitCode {
    let config = match burn_shard_launch::parse_args(std::env::args_os()) {
        Ok(config) => config,
        Err(e) => e.exit(),
    };
    let result = burn_shard_launch::forward_termination_signals().and_then(|()| burn_shard_launch::run(&config));
    match result {
        Ok(_) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("burn-shard-run: {e}");
            ExitCode::from(e.exit_code())
        }
    }
}
