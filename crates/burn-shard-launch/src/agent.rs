//! Elastic multi-node jobs: the launchers of all nodes agree on every start of the job
//! ("round") through a small store that node 0's launcher hosts at `master_port + 1` (the
//! rendezvous crate's [`StoreServer`], with the job token), as torchrun's agents do through
//! their c10d store.
//!
//! A round: every launcher registers; node 0's waits until all `nnodes` have, or
//! [`LaunchConfig::node_wait`] has passed with at least `min_nodes`, and publishes the members;
//! each member starts its ranks as node `i` of `members.len()` (its place in the list, so the
//! global ranks stay dense). While the ranks run, each launcher beats a counter every
//! [`HEARTBEAT`]; node 0's counts a node whose counter stood still for
//! [`LaunchConfig::node_timeout`] as lost. The first failure any launcher sees (its own rank,
//! a lost node) is published once; every launcher then stops its ranks, and all go on to the
//! next round or end together. The round ends well when every member's ranks exited 0.
//!
//! A node outside the running start (a lost node whose launcher was started again) registers
//! for the next one; node 0's launcher sees it, stops the start ([`LaunchError::MembersChanged`],
//! not counted against `--max-restarts`) and the next start takes it in, as torchrun's agents
//! restart their workers when a node is waiting. The ranks resume from their newest checkpoint
//! at the larger world size.
//!
//! Node 0 is where the store lives: if its launcher is lost, the others stop with an error
//! naming it (no restart: as with torchrun's c10d store, whose host must survive).

use std::net::{Ipv4Addr, SocketAddr};
use std::thread;
use std::time::{Duration, Instant};

use burn_shard_rendezvous::{RendezvousError, StoreClient, StoreLimits, StoreServer};

use crate::attempts::Attempts;
use crate::launch::launch_with;
use crate::{LaunchConfig, LaunchError, LaunchOutcome, OutputMode};

/// How often a launcher beats its counter while its ranks run.
const HEARTBEAT: Duration = Duration::from_millis(250);
/// How often a launcher asks the store whether another node failed (and node 0 reads the
/// heartbeats).
const CHECK: Duration = Duration::from_millis(100);

/// Runs an elastic job on this node: rounds until the job finishes, gives up or cannot go on
/// (see [`run`](crate::run)).
pub(crate) fn run_elastic(config: &LaunchConfig) -> Result<LaunchOutcome, LaunchError> {
    let token = config
        .token
        .clone()
        .ok_or_else(|| LaunchError::Config("several nodes need a job token".into()))?;
    let server = match config.node_rank {
        0 => Some(
            StoreServer::bind_with_limits(
                SocketAddr::from((Ipv4Addr::UNSPECIFIED, config.agent_port())),
                token.clone(),
                StoreLimits::for_world_size(config.nnodes),
            )
            .map_err(|e| {
                LaunchError::Agent(format!(
                    "node 0 cannot host the launchers' store on port {} (--master-port + 1): {e}",
                    config.agent_port()
                ))
            })?,
        ),
        _ => None,
    };
    let addr = format!("{}:{}", config.master_addr, config.agent_port());
    let client = StoreClient::connect(&addr, &token, config.node_wait).map_err(|e| {
        LaunchError::Agent(format!(
            "no launchers' store at {addr} (node 0's launcher, --master-port + 1) after {:?}: {e}",
            config.node_wait
        ))
    })?;
    let agent = Agent { config, client };
    let result = agent.rounds();
    if server.is_some() {
        // A node waiting to join a next start learns that there is none.
        let how = match &result {
            Ok(_) => "it finished".to_string(),
            Err(e) => format!("it failed: {e}"),
        };
        let _ = agent.client.set(ENDED, how.as_bytes());
    }
    if let Some(server) = server {
        // The other launchers read the round's end from it: let them leave first.
        server.wait_for_clients_to_leave(config.node_timeout);
    }
    result
}

/// This node's launcher in an elastic job.
struct Agent<'a> {
    config: &'a LaunchConfig,
    client: StoreClient,
}

impl Agent<'_> {
    fn rounds(&self) -> Result<LaunchOutcome, LaunchError> {
        let mut attempts = Attempts::new(self.config);
        self.find_current_round(&mut attempts)?;
        loop {
            let round = attempts.count();
            let Some(members) = self.join(round, &mut attempts)? else {
                // The start formed without this node: wait for the next one, which node 0's
                // launcher begins as soon as it sees this node waiting.
                self.find_current_round(&mut attempts)?;
                continue;
            };
            let result = self.run_round(round, &members, &attempts);
            if let Some(outcome) = attempts.settle(result)? {
                return Ok(outcome);
            }
        }
    }

    /// Which start a node other than 0 joins when it begins, or when a start formed without
    /// it: the one being formed, else the one after the running start (node 0's launcher stops
    /// the running start when it sees the node waiting). A node still listed in the running
    /// start waits until that start ends if its old launcher's heartbeat stands still (node 0
    /// finds it lost within `--node-timeout`); a heartbeat that moves is a second launcher with
    /// the same `--node-rank`, refused.
    fn find_current_round(&self, attempts: &mut Attempts<'_>) -> Result<(), LaunchError> {
        let config = self.config;
        if config.node_rank == 0 {
            return Ok(());
        }
        // The running start and this node's heartbeat count in it, as first read.
        let mut beat: Option<(usize, i64)> = None;
        loop {
            self.check_ended()?;
            let Some(current) = self.client.try_get(CURRENT, Duration::ZERO).map_err(lost)? else {
                return Ok(()); // the job's first round, or node 0 has not got that far
            };
            let round: usize = String::from_utf8_lossy(&current).parse().unwrap_or(0);
            let members = self
                .client
                .try_get(&self.key(round, "members"), Duration::ZERO)
                .map_err(lost)?;
            let Some(members) = members.map(|m| String::from_utf8_lossy(&m).into_owned()) else {
                attempts.join_at(round); // being formed: join it
                return Ok(());
            };
            if !members.starts_with('!') && !parse_list(&members).contains(&config.node_rank) {
                attempts.join_at(round + 1);
                return Ok(());
            }
            let beats = self
                .client
                .add(&self.key(round, &format!("beat-{}", config.node_rank)), 0)
                .map_err(lost)?;
            match beat {
                Some((seen_round, seen)) if seen_round == round && seen != beats => {
                    return Err(LaunchError::Agent(format!(
                        "node {0} is a member of the running start {round} (nodes {members}) and its launcher's \
                         heartbeat moves: another burn-shard-run with --node-rank {0} is running; each node's \
                         --node-rank must be unique",
                        config.node_rank
                    )));
                }
                Some((seen_round, _)) if seen_round == round => {}
                _ => beat = Some((round, beats)),
            }
            if let Some(interrupted) = attempts.interrupted() {
                return Err(interrupted);
            }
            thread::sleep(CHECK);
        }
    }

    /// An error when node 0's launcher said that the job has ended: a node waiting for a start
    /// learns there is none.
    fn check_ended(&self) -> Result<(), LaunchError> {
        match self.client.try_get(ENDED, Duration::ZERO).map_err(lost)? {
            Some(how) => Err(LaunchError::Agent(format!(
                "the job ended while node {} waited for a start: {}",
                self.config.node_rank,
                String::from_utf8_lossy(&how)
            ))),
            None => Ok(()),
        }
    }

    /// Records that this node's registration `claim` for `round` stopped waiting (interrupted,
    /// or gave up), so that node 0 does not count it a member (a launcher started again
    /// registers anew, with a new claim); returns `error`.
    fn leave(&self, round: usize, claim: i64, error: LaunchError) -> LaunchError {
        let key = self.key(round, &format!("left-{}", self.config.node_rank));
        let _ = self.client.set(&key, claim.to_string().as_bytes());
        error
    }

    fn key(&self, round: usize, what: &str) -> String {
        format!("burn-shard-agent/round-{round}/{what}")
    }

    /// Registers this node for `round` and returns the round's members (node ranks, ascending),
    /// which node 0's launcher decides, or `None` when the round formed without this node. A
    /// termination signal while waiting ends the job.
    fn join(&self, round: usize, attempts: &mut Attempts<'_>) -> Result<Option<Vec<usize>>, LaunchError> {
        let (config, store) = (self.config, &self.client);
        if config.node_rank == 0 {
            store.set(CURRENT, round.to_string().as_bytes()).map_err(lost)?;
        }
        // Each registration of this node gets its own number (its claim), and the node's key
        // holds the last one: node 0 names the claim it counted, so that of two launchers
        // with the same --node-rank (or a launcher started again), exactly one runs the ranks.
        let claim = store
            .add(&self.key(round, &format!("node-{}-count", config.node_rank)), 1)
            .map_err(lost)?;
        store
            .set(
                &self.key(round, &format!("node-{}", config.node_rank)),
                claim.to_string().as_bytes(),
            )
            .map_err(lost)?;
        if claim == 1 {
            store.add(&self.key(round, "joined"), 1).map_err(lost)?;
        }
        let members_key = self.key(round, "members");
        if config.node_rank == 0 {
            let deadline = Instant::now() + config.node_wait;
            while (store.add(&self.key(round, "joined"), 0).map_err(lost)? as usize) < config.nnodes
                && Instant::now() < deadline
            {
                if let Some(interrupted) = attempts.interrupted() {
                    // The others learn it from the members they wait for.
                    let _ = store.set(
                        &members_key,
                        format!("!node 0 was interrupted ({interrupted})").as_bytes(),
                    );
                    return Err(interrupted);
                }
                thread::sleep(CHECK);
            }
            let mut members = Vec::new();
            for node in 0..config.nnodes {
                let get = |what: &str| -> Result<Option<Vec<u8>>, LaunchError> {
                    let key = self.key(round, &format!("{what}-{node}"));
                    store.try_get(&key, Duration::ZERO).map_err(lost)
                };
                // The node's last registration, unless it was withdrawn.
                let Some(claim) = get("node")? else { continue };
                if get("left")?.is_some_and(|left| left == claim) {
                    continue;
                }
                store
                    .set(&self.key(round, &format!("claim-{node}")), &claim)
                    .map_err(lost)?;
                members.push(node);
            }
            let published = match members.len() >= config.min_nodes {
                true => list(&members),
                false => format!(
                    "!start {round}: only {} of the {} nodes needed (--nnodes {}:{}) came within --node-wait {:?} \
                     (nodes {}); start the missing nodes' burn-shard-run, or lower MIN",
                    members.len(),
                    config.min_nodes,
                    config.min_nodes,
                    config.nnodes,
                    config.node_wait,
                    list(&members)
                ),
            };
            // Before the members: a node that reads them finds the count.
            let restarts = attempts.restarts().to_string();
            store
                .set(&self.key(round, "restarts"), restarts.as_bytes())
                .map_err(lost)?;
            store.set(&members_key, published.as_bytes()).map_err(lost)?;
        }
        // Node 0 may first stop the running start's ranks (--stop-grace), then waits for the
        // nodes (--node-wait). While the start before this one still runs (node 0 has not
        // begun this one), a waiting node waits for it to end.
        let patience = config.node_wait + config.node_timeout + config.stop_grace;
        let mut deadline = Instant::now() + patience;
        let value = loop {
            if let Some(value) = store.try_get(&members_key, Duration::ZERO).map_err(lost)? {
                break String::from_utf8_lossy(&value).into_owned();
            }
            if let Some(interrupted) = attempts.interrupted() {
                return Err(self.leave(round, claim, interrupted));
            }
            if config.node_rank != 0 {
                self.check_ended().map_err(|e| self.leave(round, claim, e))?;
                let current = store.try_get(CURRENT, Duration::ZERO).map_err(lost)?;
                let current: Option<usize> = current.and_then(|c| String::from_utf8_lossy(&c).parse().ok());
                if current.is_some_and(|c| c < round) {
                    deadline = Instant::now() + patience;
                }
            }
            if Instant::now() >= deadline {
                return Err(self.leave(
                    round,
                    claim,
                    LaunchError::Agent(format!(
                        "node 0 did not say which nodes make start {round} within --node-wait + --node-timeout + \
                     --stop-grace ({patience:?}): is node 0's burn-shard-run running with the same --master-addr \
                     and --master-port?"
                    )),
                ));
            }
            thread::sleep(CHECK);
        };
        if let Some(problem) = value.strip_prefix('!') {
            return Err(LaunchError::Agent(problem.to_string()));
        }
        let members = parse_list(&value);
        if !members.contains(&config.node_rank) {
            return Ok(None);
        }
        if config.node_rank != 0 {
            let counted = store
                .get(
                    &self.key(round, &format!("claim-{}", config.node_rank)),
                    config.node_timeout,
                )
                .map_err(lost)?;
            if counted != claim.to_string().into_bytes() {
                // Node 0 counted another registration of this node: a second launcher with this
                // --node-rank (refused once its heartbeat is seen moving in the start), or this
                // launcher's predecessor, killed (then this one joins the next start).
                return Ok(None);
            }
            let restarts = store
                .get(&self.key(round, "restarts"), config.node_timeout)
                .map_err(lost)?;
            attempts.agree(String::from_utf8_lossy(&restarts).parse().unwrap_or(0));
        }
        if config.output == OutputMode::Prefix && (round > 0 || members.len() < config.nnodes) {
            eprintln!(
                "burn-shard-run: start {round}: nodes {value} of {}, world size {}",
                config.nnodes,
                members.len() * config.nproc_per_node
            );
        }
        Ok(Some(members))
    }

    /// Starts this node's ranks as node `index` of the members and watches them and the other
    /// nodes until the round ends: `Ok` when every member's ranks exited 0.
    fn run_round(
        &self,
        round: usize,
        members: &[usize],
        attempts: &Attempts<'_>,
    ) -> Result<LaunchOutcome, LaunchError> {
        let index = members.iter().position(|&n| n == self.config.node_rank).unwrap_or(0);
        let config = self.config.clone().with_nodes(members.len(), index);
        let mut watch = RoundWatch::new(self, round, members);
        let launched = launch_with(&config, &attempts.env(), &mut || watch.check(), attempts.signals_before);
        let outcome = match launched {
            Ok(outcome) => outcome,
            Err(error @ (LaunchError::Stopped { .. } | LaunchError::MembersChanged { .. } | LaunchError::Agent(_))) => {
                return Err(error);
            }
            Err(error) => return Err(self.fail(round, error)),
        };
        // This node's ranks finished: a node asking to join now waits for the job's end.
        watch.admit_joins = false;
        self.client.add(&self.key(round, "done"), 1).map_err(lost)?;
        loop {
            if self.client.add(&self.key(round, "done"), 0).map_err(lost)? as usize >= members.len() {
                return Ok(outcome);
            }
            if let Some(error) = watch.check() {
                return Err(error);
            }
            if let Some(interrupted) = attempts.interrupted() {
                return Err(self.fail(round, interrupted));
            }
            thread::sleep(CHECK);
        }
    }

    /// This node's `error` ended its part of `round`: publishes it (unless another node's
    /// failure came first) and returns the round's failure as every node sees it, so that all
    /// restart, or all end, alike.
    fn fail(&self, round: usize, error: LaunchError) -> LaunchError {
        let cause = format!("node {}: {error}", self.config.node_rank);
        let published = self
            .publish(round, &cause, error.exit_code(), error.is_restartable())
            .and_then(|()| self.client.get(&self.key(round, "failure"), self.config.node_timeout));
        match published {
            Ok(failure) => stopped(&failure),
            // The store is gone: this node's own error is all there is.
            Err(_) => error,
        }
    }

    /// Publishes the round's failure, unless another launcher published one first.
    fn publish(&self, round: usize, cause: &str, code: u8, restartable: bool) -> Result<(), RendezvousError> {
        self.publish_end(round, &format!("{code}\n{}\n{cause}", u8::from(restartable)))
    }

    /// Publishes why `round` ends early (a failure, or [`MEMBERS_CHANGED`]), unless another
    /// launcher published a reason first.
    fn publish_end(&self, round: usize, value: &str) -> Result<(), RendezvousError> {
        if self.client.add(&self.key(round, "failures"), 1)? == 1 {
            self.client.set(&self.key(round, "failure"), value.as_bytes())?;
        }
        Ok(())
    }
}

/// What a launcher checks while its ranks run: its own heartbeat, another node's published
/// failure, and on node 0 the other members' heartbeats and nodes asking to join.
struct RoundWatch<'a> {
    agent: &'a Agent<'a>,
    round: usize,
    /// Each other member's last heartbeat count and when it last changed (node 0 only).
    peers: Vec<(usize, i64, Instant)>,
    /// The nodes outside this round (node 0 only): one that registers for the next round
    /// while this node's ranks run stops the round ([`LaunchError::MembersChanged`]).
    absent: Vec<usize>,
    /// Whether a node asking to join stops the round: while this node's ranks run.
    admit_joins: bool,
    last_check: Option<Instant>,
    last_beat: Option<Instant>,
}

impl<'a> RoundWatch<'a> {
    fn new(agent: &'a Agent<'a>, round: usize, members: &[usize]) -> Self {
        let peers = match agent.config.node_rank {
            0 => members
                .iter()
                .filter(|&&n| n != 0)
                .map(|&n| (n, 0, Instant::now()))
                .collect(),
            _ => Vec::new(),
        };
        let absent = match agent.config.node_rank {
            0 => (0..agent.config.nnodes).filter(|n| !members.contains(n)).collect(),
            _ => Vec::new(),
        };
        Self {
            agent,
            round,
            peers,
            absent,
            admit_joins: true,
            last_check: None,
            last_beat: None,
        }
    }

    /// `Some(error)` when this node's ranks must stop: another node failed or was lost, or the
    /// store is gone. Asks the store at most every [`CHECK`].
    fn check(&mut self) -> Option<LaunchError> {
        let now = Instant::now();
        if self.last_check.is_some_and(|t| now - t < CHECK) {
            return None;
        }
        self.last_check = Some(now);
        match self.ask(now) {
            Ok(found) => found,
            Err(e) => Some(lost(e)),
        }
    }

    fn ask(&mut self, now: Instant) -> Result<Option<LaunchError>, RendezvousError> {
        let agent = self.agent;
        let store = &agent.client;
        if self.last_beat.is_none_or(|t| now - t >= HEARTBEAT) {
            store.add(&agent.key(self.round, &format!("beat-{}", agent.config.node_rank)), 1)?;
            self.last_beat = Some(now);
        }
        if let Some(failure) = store.try_get(&agent.key(self.round, "failure"), Duration::ZERO)? {
            return Ok(Some(stopped(&failure)));
        }
        for (node, count, since) in &mut self.peers {
            let beats = store.add(&agent.key(self.round, &format!("beat-{node}")), 0)?;
            if beats != *count {
                (*count, *since) = (beats, now);
            } else if now - *since > agent.config.node_timeout {
                let cause = format!(
                    "node {node}'s launcher stopped answering for {:.1} s (--node-timeout): the node is lost",
                    (now - *since).as_secs_f64()
                );
                agent.publish(self.round, &cause, 1, true)?;
                let failure = store.get(&agent.key(self.round, "failure"), agent.config.node_timeout)?;
                return Ok(Some(stopped(&failure)));
            }
        }
        if self.admit_joins
            && !self.absent.is_empty()
            && store.add(&agent.key(self.round + 1, "joined"), 0)? > 0
            // A member whose ranks finished (its program may be writing its last files): the
            // start is left to end, and the waiting node learns that the job ended.
            && store.add(&agent.key(self.round, "done"), 0)? == 0
        {
            let mut waiting = Vec::new();
            for &node in &self.absent {
                let key = agent.key(self.round + 1, &format!("node-{node}"));
                if store.try_get(&key, Duration::ZERO)?.is_some() {
                    waiting.push(node);
                }
            }
            if waiting.is_empty() {
                return Ok(None); // a member's registration (it failed and moved on): its failure stops the round
            }
            let cause = format!(
                "node(s) {} asked to join: start {} takes them in (a change of members, not counted against \
                 --max-restarts)",
                list(&waiting),
                self.round + 1
            );
            agent.publish_end(self.round, &format!("{MEMBERS_CHANGED}\n{cause}"))?;
            let failure = store.get(&agent.key(self.round, "failure"), agent.config.node_timeout)?;
            return Ok(Some(stopped(&failure)));
        }
        Ok(None)
    }
}

/// The error of a published failure (`code\nrestartable\ncause`), or of a change of members
/// (`MEMBERS_CHANGED\ncause`).
fn stopped(failure: &[u8]) -> LaunchError {
    let text = String::from_utf8_lossy(failure);
    if let Some(cause) = text.strip_prefix(MEMBERS_CHANGED).and_then(|t| t.strip_prefix('\n')) {
        return LaunchError::MembersChanged {
            cause: cause.to_string(),
        };
    }
    let mut lines = text.splitn(3, '\n');
    let (code, restartable, cause) = (lines.next(), lines.next(), lines.next());
    LaunchError::Stopped {
        cause: cause.unwrap_or(&text).to_string(),
        code: code.and_then(|c| c.parse().ok()).unwrap_or(1),
        restartable: restartable == Some("1"),
    }
}

/// A request to the launchers' store failed: usually node 0's launcher, which hosts it, is gone.
fn lost(error: RendezvousError) -> LaunchError {
    LaunchError::Agent(format!(
        "the launchers' store on node 0 failed ({error}): if node 0's launcher is gone, so is the job's \
         coordination; start the job again (it resumes from its newest checkpoint)"
    ))
}

/// The key where node 0 says which start is being formed or run.
const CURRENT: &str = "burn-shard-agent/current";
/// The key where node 0 says that the job has ended, and how.
const ENDED: &str = "burn-shard-agent/ended";
/// The first line of a round's published end when a node asked to join (a failure's first
/// line is its exit code, a number).
const MEMBERS_CHANGED: &str = "members-changed";

/// `[0, 1, 3]` from `0,1,3`.
fn parse_list(text: &str) -> Vec<usize> {
    text.split(',').filter_map(|n| n.parse().ok()).collect()
}

/// `0,1,3`.
fn list(nodes: &[usize]) -> String {
    nodes.iter().map(ToString::to_string).collect::<Vec<_>>().join(",")
}
