//! The fine-tuning examples: the pretrained models' ports against published outputs, their
//! loaders against files in the original formats, and a few steps of each example end to end
//! (the loss falls; the CSV and the PNG are written).

use std::path::Path;

use burn::module::Module;
use burn::prelude::*;
use burn_shard_examples::bert::{Bert, BertConfig};
use burn_shard_examples::examples_data_dir;
use burn_shard_examples::llama::Llama;
use burn_shard_examples::llama2c_tokenizer::{BOS, Llama2cTokenizer};
use burn_shard_examples::metrics::Row;
use burn_shard_examples::sentences::{Sentence, batch, load_tokenizer, read_labelled};
use burn_shard_examples::{finetune_minilm, finetune_minilm_learner, finetune_stories, minilm_weights};
use clap::Parser;

use crate::common::{Rng, max_abs_diff, params_of, scratch};

fn stories260k() -> (Llama, Llama2cTokenizer) {
    let dir = examples_data_dir().join("stories260K");
    let (config, model) = Llama::load_llama2c(&dir.join("stories260K.bin"), &Device::flex()).unwrap();
    let tokenizer = Llama2cTokenizer::from_file(&dir.join("tok512.bin"), config.vocab_size).unwrap();
    (model, tokenizer)
}

/// llama2.c's published greedy output of stories260K from BOS (its README; also
/// examples/data/README.md). Wrong RoPE pairing, head sharing, tied classifier or
/// transposition all change the story.
#[test]
fn stories260k_port_tells_the_published_story() {
    let (model, tokenizer) = stories260k();
    assert_eq!(model.num_params(), 260_032, "the data README's parameter count");
    let story = finetune_stories::greedy_story(&model, &tokenizer, 48, 512);
    assert!(story.starts_with(PUBLISHED_STORY), "greedy story: {story:?}");
}

/// The start of llama2.c's published greedy story of stories260K from BOS.
const PUBLISHED_STORY: &str =
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park.";

/// Encoding then decoding gives the text back (byte fallback included), and the pieces are
/// BPE merges: far fewer tokens than bytes.
#[test]
fn llama2c_tokenizer_round_trips_shakespeare() {
    let (_, tokenizer) = stories260k();
    let text = std::fs::read_to_string(examples_data_dir().join("tinyshakespeare.txt")).unwrap();
    let text: String = text.chars().take(5000).chain("\u{e9}\u{1f600}\n".chars()).collect();
    let ids = tokenizer.encode(&text, true);
    assert_eq!(ids[0], BOS);
    assert_eq!(tokenizer.decode(BOS, &ids[1..]), text);
    assert!(
        ids.len() * 3 < text.len() * 2,
        "{} tokens for {} bytes",
        ids.len(),
        text.len()
    );
    // Merges never cross a newline (it has no piece of its own), so `encode`'s line-by-line
    // encoding gives llama2.c's ids for the text as one segment.
    assert_eq!(ids, tokenizer.encode_whole(&text, true));
}

/// A Hugging Face BERT file in miniature: the tensor names and `[out, in]` layouts of
/// all-MiniLM-L6-v2's `model.safetensors`, random values, vocabulary of the real tokenizer.
fn write_tiny_bert(dir: &Path, config: &BertConfig) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let (h, f) = (config.hidden_size, config.intermediate_size);
    let mut shapes: Vec<(String, Vec<usize>)> = vec![
        ("embeddings.word_embeddings.weight".into(), vec![config.vocab_size, h]),
        (
            "embeddings.position_embeddings.weight".into(),
            vec![config.max_position_embeddings, h],
        ),
        (
            "embeddings.token_type_embeddings.weight".into(),
            vec![config.type_vocab_size, h],
        ),
        ("embeddings.LayerNorm.weight".into(), vec![h]),
        ("embeddings.LayerNorm.bias".into(), vec![h]),
        ("pooler.dense.weight".into(), vec![h, h]),
        ("pooler.dense.bias".into(), vec![h]),
    ];
    for l in 0..config.num_hidden_layers {
        let p = format!("encoder.layer.{l}.");
        for (name, shape) in [
            ("attention.self.query.weight", vec![h, h]),
            ("attention.self.query.bias", vec![h]),
            ("attention.self.key.weight", vec![h, h]),
            ("attention.self.key.bias", vec![h]),
            ("attention.self.value.weight", vec![h, h]),
            ("attention.self.value.bias", vec![h]),
            ("attention.output.dense.weight", vec![h, h]),
            ("attention.output.dense.bias", vec![h]),
            ("attention.output.LayerNorm.weight", vec![h]),
            ("attention.output.LayerNorm.bias", vec![h]),
            ("intermediate.dense.weight", vec![f, h]),
            ("intermediate.dense.bias", vec![f]),
            ("output.dense.weight", vec![h, f]),
            ("output.dense.bias", vec![h]),
            ("output.LayerNorm.weight", vec![h]),
            ("output.LayerNorm.bias", vec![h]),
        ] {
            shapes.push((format!("{p}{name}"), shape));
        }
    }
    let mut rng = Rng::new(7);
    let tensors: Vec<(String, Vec<usize>, Vec<f32>)> = shapes
        .into_iter()
        .map(|(name, shape)| {
            let n = shape.iter().product();
            // LayerNorm weights near 1 (as trained ones are), everything else small.
            let center = if name.contains("LayerNorm.weight") { 1.0 } else { 0.0 };
            let values = rng.vec(n).into_iter().map(|v| center + 0.2 * v).collect();
            (name, shape, values)
        })
        .collect();
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, _, v)| v.iter().flat_map(|x| x.to_le_bytes()).collect())
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .zip(&bytes)
        .map(|((name, shape, _), b)| {
            let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), b).unwrap();
            (name.clone(), view)
        })
        .collect();
    std::fs::write(
        dir.join("model.safetensors"),
        safetensors::serialize(views, None).unwrap(),
    )
    .unwrap();
    let json = serde_json::json!({
        "vocab_size": config.vocab_size, "hidden_size": h, "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads, "intermediate_size": f,
        "max_position_embeddings": config.max_position_embeddings, "type_vocab_size": config.type_vocab_size,
        "layer_norm_eps": config.layer_norm_eps, "hidden_act": config.hidden_act, "model_type": "bert",
    });
    std::fs::write(dir.join("config.json"), json.to_string()).unwrap();
    tensors
}

fn tiny_config() -> BertConfig {
    BertConfig {
        vocab_size: 30522,
        hidden_size: 16,
        num_hidden_layers: 2,
        num_attention_heads: 2,
        intermediate_size: 32,
        max_position_embeddings: 64,
        type_vocab_size: 2,
        layer_norm_eps: 1e-12,
        hidden_act: "gelu".into(),
    }
}

fn values(t: Tensor<2>) -> Vec<f32> {
    t.into_data().convert::<f32>().iter::<f32>().collect()
}

/// Hugging Face names land on the right Burn modules, `[out, in]` weights are transposed and
/// LayerNorm's weight/bias become gamma/beta; a file of another size or a missing file is an
/// error that names the tensor or the fetch command.
#[test]
fn bert_loader_maps_hugging_face_files() {
    let dir = scratch("examples-tests", "tiny-bert");
    let config = tiny_config();
    let tensors = write_tiny_bert(&dir, &config);
    let device = Device::flex();
    let bert: Bert = BertConfig::from_file(&dir.join("config.json"))
        .unwrap()
        .init(0.0, &device)
        .load_safetensors(&dir.join("model.safetensors"))
        .unwrap();
    let hf = |name: &str| tensors.iter().find(|t| t.0 == name).unwrap();
    let (_, shape, q) = hf("encoder.layer.1.attention.self.query.weight");
    let burn_q = values(bert.encoder.layers[1].mha.query.weight.val());
    let (out, inp) = (shape[0], shape[1]);
    for o in 0..out {
        for i in 0..inp {
            assert_eq!(burn_q[i * out + o], q[o * inp + i], "query[{o}, {i}] transposed");
        }
    }
    let (_, _, ffn_in) = hf("encoder.layer.0.intermediate.dense.bias");
    let burn_bias = bert.encoder.layers[0].pwff.linear_inner.bias.as_ref().unwrap().val();
    assert_eq!(burn_bias.into_data().iter::<f32>().collect::<Vec<_>>(), *ffn_in);
    let (_, _, ln) = hf("encoder.layer.1.output.LayerNorm.bias");
    let beta = bert.encoder.layers[1].norm_2.beta.as_ref().unwrap().val();
    assert_eq!(beta.into_data().iter::<f32>().collect::<Vec<_>>(), *ln);
    let (_, _, words) = hf("embeddings.word_embeddings.weight");
    assert_eq!(values(bert.embeddings.word_embeddings.weight.val())[..64], words[..64]);

    // A config that does not match the file: the error names a tensor and both shapes.
    let wrong = BertConfig {
        intermediate_size: 48,
        ..config.clone()
    };
    let err = wrong
        .init(0.0, &device)
        .load_safetensors(&dir.join("model.safetensors"))
        .unwrap_err();
    assert!(err.contains("linear_inner") && err.contains("48"), "{err}");
    // A missing file says how to get it.
    let err = minilm_weights::require_files(&dir.join("nowhere")).unwrap_err();
    assert!(err.contains("cargo xtask fetch-minilm"), "{err}");
}

/// The fine-tuning example's route: a lazy `SentenceClassifier` loaded by `init_pretrained` with
/// `SentenceClassifier::pretrained` (Hugging Face names and layout, the pooler skipped, the head
/// kept) on 2 ranks at stages 0 and 3 holds bitwise the encoder `Bert::load_safetensors` loads
/// into a whole model, and the head `SentenceClassifier::new` made, on both ranks.
#[test]
fn minilm_classifier_loads_into_shards_as_into_a_whole_model() {
    use burn_shard::comm::{Collective, InProcessGroup, run_ranks};
    use burn_shard::{ShardConfig, Stage};
    use burn_shard_examples::bert::SentenceClassifier;
    let dir = scratch("examples-tests", "tiny-bert-sharded");
    write_tiny_bert(&dir, &tiny_config());
    let weights = dir.join("model.safetensors");
    let device = Device::flex().autodiff();
    let whole = SentenceClassifier::new(
        tiny_config().init(0.0, &device).load_safetensors(&weights).unwrap(),
        3,
        0.0,
        7,
        &device,
    );
    let expected = params_of(&whole);
    for stage in [Stage::Zero, Stage::Three] {
        let ranks = run_ranks(InProcessGroup::new(2).unwrap(), |comm| {
            let model = SentenceClassifier::new(tiny_config().init(0.0, &device), 3, 0.0, 7, &device);
            let pretrained = SentenceClassifier::pretrained(&weights).unwrap();
            let rank = comm.rank();
            let (model, _) = ShardConfig::new(stage)
                .init_pretrained(model, pretrained, burn::optim::AdamWConfig::new(), comm)
                .unwrap();
            (rank, params_of(&model.materialize()))
        })
        .unwrap();
        for (rank, got) in ranks {
            assert_eq!(
                got, expected,
                "stage {stage}, rank {rank}: differs from the whole model's load"
            );
        }
    }
}

/// Published check of the real weights (the data README of the project's shared data): mean-pooled embeddings of
/// two sentences have cosine similarity 0.755. Runs when `cargo xtask fetch-minilm` has
/// fetched the weights (CI does, in `cargo xtask setup`), and must run when
/// BURN_SHARD_REQUIRE_MINILM is set.
#[test]
fn minilm_embeddings_match_the_published_similarity() {
    let dir = minilm_weights::default_model_dir();
    if let Err(e) = minilm_weights::verify(&dir) {
        assert!(std::env::var_os("BURN_SHARD_REQUIRE_MINILM").is_none(), "{e}");
        println!("skipped: {e}");
        return;
    }
    let device = Device::flex();
    let bert = BertConfig::from_file(&dir.join("config.json"))
        .unwrap()
        .init(0.0, &device)
        .load_safetensors(&dir.join("model.safetensors"))
        .unwrap();
    let tokenizer = load_tokenizer(
        &examples_data_dir().join("all-MiniLM-L6-v2-tokenizer/tokenizer.json"),
        128,
    )
    .unwrap();
    let file = scratch("examples-tests", "pair").join("pair.txt");
    std::fs::write(&file, "0 A man is eating food.\n0 A man is eating a piece of bread.\n").unwrap();
    let sentences = read_labelled(&file, 2, &tokenizer).unwrap();
    let (ids, pad, _) = batch(&sentences.iter().collect::<Vec<_>>(), &device);
    let e = values(bert.mean_pooled(ids, pad));
    let (a, b) = e.split_at(e.len() / 2);
    let dot: f32 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let norm = |v: &[f32]| v.iter().map(|x| x * x).sum::<f32>().sqrt();
    let cosine = dot / (norm(a) * norm(b));
    assert!((cosine - 0.755).abs() < 0.0015, "cosine {cosine}, published 0.755");
}

fn rows(csv: &Path) -> Vec<Row> {
    let text = std::fs::read_to_string(csv).unwrap();
    text.lines()
        .skip(1)
        .map(|l| {
            let cell = |s: &str| (!s.is_empty()).then(|| s.parse::<f32>().unwrap());
            let c: Vec<&str> = l.split(',').collect();
            Row {
                step: c[0].parse().unwrap(),
                train_loss: cell(c[1]),
                val_loss: cell(c[2]),
                val_accuracy: cell(c[3]),
                seconds: c
                    .get(4)
                    .and_then(|s| (!s.is_empty()).then(|| s.parse::<f64>().unwrap())),
            }
        })
        .collect()
}

fn assert_png(path: &Path) {
    let bytes = std::fs::read(path).unwrap();
    assert!(
        bytes.starts_with(b"\x89PNG\r\n\x1a\n") && bytes.len() > 5000,
        "{} is not a plot",
        path.display()
    );
}

fn mean(v: &[f32]) -> f32 {
    v.iter().sum::<f32>() / v.len() as f32
}

/// A short `finetune-stories` run of `steps` steps on a small slice of the data, evaluated
/// every 8 steps, with `extra` options.
fn stories_args(steps: &str, extra: &[&str]) -> finetune_stories::Args {
    let mut a = vec![
        "finetune-stories",
        "--steps",
        steps,
        "--batch-size",
        "8",
        "--block-size",
        "48",
        "--limit-chars",
        "40000",
        "--eval-interval",
        "8",
        "--eval-batches",
        "2",
        "--sample-tokens",
        "8",
        "--lr",
        "3e-3",
    ];
    a.extend_from_slice(extra);
    finetune_stories::Args::parse_from(a)
}

/// A few steps of `finetune-stories` at stage 3 on 2 ranks: the validation loss on
/// shakespeare falls from the pretrained model's, the CSV holds every step, the PNG is drawn,
/// and a resumed run continues from the checkpoint.
#[test]
fn finetune_stories_smoke() {
    let out = scratch("examples-tests", "stories");
    let args = |extra: &[&str]| stories_args("16", extra);
    let ckpt = out.join("ckpt");
    let summary = finetune_stories::run(args(&[
        "--world-size",
        "2",
        "--stage",
        "3",
        "--out",
        out.to_str().unwrap(),
        "--save-dir",
        ckpt.to_str().unwrap(),
        "--save-every",
        "8",
    ]))
    .unwrap();
    // Told by the model loaded straight into the shards of 2 ranks: the published story's start.
    let story = &summary.pretrained_story;
    assert!(
        story.len() > 20 && PUBLISHED_STORY.starts_with(story.trim_end()),
        "{story:?} is not the start of the published story"
    );
    let csv = rows(&out.join("metrics.csv"));
    assert_eq!(csv, summary.metrics.rows);
    let vals: Vec<f32> = csv.iter().filter_map(|r| r.val_loss).collect();
    assert_eq!(vals.len(), 3, "before, at 8, at 16");
    assert!(vals[2] < vals[0] - 0.2, "val loss {vals:?} did not fall");
    assert_eq!(csv.iter().filter(|r| r.train_loss.is_some()).count(), 16);
    assert_png(&out.join("losses.png"));

    // Resume at step 8 on 1 rank at stage 2, writing into the same --out: the global batches
    // do not depend on the world size, so steps 9-16 are the uninterrupted run's (up to the
    // order of float sums), and the CSV continues the first run's rows.
    let resumed = finetune_stories::run(args(&[
        "--world-size",
        "1",
        "--stage",
        "2",
        "--out",
        out.to_str().unwrap(),
        "--resume",
        ckpt.join("step-000008").to_str().unwrap(),
    ]))
    .unwrap();
    assert_eq!(resumed.start, 8);
    let continued = rows(&out.join("metrics.csv"));
    assert_eq!(continued.len(), csv.len());
    for (a, b) in csv.iter().zip(&continued) {
        assert_eq!(a.step, b.step);
        if a.step <= 8 {
            assert_eq!(a, b, "rows up to the checkpoint are the first run's");
        }
        for (x, y) in [(a.train_loss, b.train_loss), (a.val_loss, b.val_loss)] {
            let (x, y) = (x.unwrap_or(0.0), y.unwrap_or(0.0));
            assert!(
                (x - y).abs() < 1e-4 * x.abs().max(1.0),
                "step {}: {x} uninterrupted, {y} resumed",
                a.step
            );
        }
    }
}

/// Mean pooling ignores padding: a sentence pools to the same vector alone and padded in a
/// batch with a longer one (the attention's padding mask and the pooling's both matter).
#[test]
fn bert_mean_pooling_ignores_padding() {
    let dir = scratch("examples-tests", "tiny-bert-pooling");
    write_tiny_bert(&dir, &tiny_config());
    let device = Device::flex();
    let bert = tiny_config()
        .init(0.0, &device)
        .load_safetensors(&dir.join("model.safetensors"))
        .unwrap();
    let short = Sentence {
        label: 0,
        ids: vec![101, 2023, 2003, 102],
    };
    let long = Sentence {
        label: 0,
        ids: vec![101, 1037, 2936, 6251, 2007, 2062, 19204, 2015, 102],
    };
    let pooled = |batch_of: &[&Sentence]| {
        let (ids, pad, _) = batch(batch_of, &device);
        values(bert.mean_pooled(ids, pad))
    };
    let alone = pooled(&[&short]);
    let padded = pooled(&[&short, &long]);
    let h = alone.len();
    let diff = alone
        .iter()
        .zip(&padded[..h])
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max);
    assert!(diff < 1e-5, "padding changed the pooled vector by {diff}");
    assert!(
        padded[h..].iter().zip(&alone).any(|(a, b)| (a - b).abs() > 1e-3),
        "the two sentences pool alike"
    );
}

/// A few steps of `finetune-minilm` on a tiny BERT in Hugging Face's file format at stages 0
/// and 3 on 2 ranks: training loss falls on a small repeated set, both stages agree, the CSV
/// and PNG are written.
#[test]
fn finetune_minilm_smoke() {
    let model_dir = scratch("examples-tests", "minilm-model");
    write_tiny_bert(&model_dir, &tiny_config());
    let run = |stage: &str| {
        let out = scratch("examples-tests", &format!("minilm-{stage}"));
        let summary = finetune_minilm::run(finetune_minilm::Args::parse_from([
            "finetune-minilm",
            "--world-size",
            "2",
            "--stage",
            stage,
            "--model-dir",
            model_dir.to_str().unwrap(),
            "--limit-train",
            "32",
            "--limit-eval",
            "24",
            "--batch-size",
            "8",
            "--steps",
            "24",
            "--lr",
            "1e-2",
            "--warmup",
            "0",
            "--dropout",
            "0",
            "--eval-interval",
            "8",
            "--out",
            out.to_str().unwrap(),
        ]))
        .unwrap();
        assert_png(&out.join("losses.png"));
        assert_eq!(rows(&out.join("metrics.csv")), summary.metrics.rows);
        summary
    };
    let s0 = run("0");
    let train: Vec<f32> = s0.metrics.rows.iter().filter_map(|r| r.train_loss).collect();
    assert_eq!(train.len(), 24);
    // 32 sentences are 4 batches: epoch 1 against epoch 6 (measured: 0.71 -> 0.24).
    assert!(
        mean(&train[20..]) < mean(&train[..4]) * 0.6,
        "train loss {train:?} did not fall"
    );
    assert!((0.0..=1.0).contains(&s0.accuracy));
    let s3 = run("3");
    assert_eq!(s0.metrics.rows.len(), s3.metrics.rows.len());
    for (a, b) in s0.metrics.rows.iter().zip(&s3.metrics.rows) {
        let (a, b) = (
            a.train_loss.or(a.val_loss).unwrap(),
            b.train_loss.or(b.val_loss).unwrap(),
        );
        assert!((a - b).abs() < 1e-3 * a.abs().max(1.0), "stage 0 {a} vs stage 3 {b}");
    }
}

/// `finetune-minilm-learner` (burn-train's Learner with `ShardedStrategy`) on a tiny BERT in
/// Hugging Face's file format: stages 2 and 3 on 2 ranks end with the parameters of stage 0 on
/// 2 ranks, the logged training loss falls, and burn-train wrote its validation accuracy. (At
/// another world size the shuffled loader's shares, and so the batches, differ.)
#[test]
fn finetune_minilm_learner_trains_alike_at_every_stage() {
    let model_dir = scratch("examples-tests", "minilm-learner-model");
    write_tiny_bert(&model_dir, &tiny_config());
    let run = |world: &str, stage: &str| {
        let out = scratch("examples-tests", &format!("minilm-learner-{world}-{stage}"));
        let args = finetune_minilm_learner::Args::parse_from([
            "finetune-minilm-learner",
            "--world-size",
            world,
            "--stage",
            stage,
            "--model-dir",
            model_dir.to_str().unwrap(),
            "--limit-train",
            "32",
            "--limit-eval",
            "16",
            "--batch-size",
            "8",
            "--epochs",
            "3",
            "--lr",
            "1e-2",
            "--dropout",
            "0",
            // Lines, not burn-train's dashboard, also when the tests run in a terminal.
            "--plain",
            "--out",
            out.to_str().unwrap(),
        ]);
        let result = finetune_minilm_learner::run(args).unwrap();
        (params_of(&result.model), out)
    };
    let (stage0, out) = run("2", "0");
    for (world, stage) in [("2", "3"), ("2", "2")] {
        let (params, _) = run(world, stage);
        let diff = max_abs_diff(&params, &stage0);
        assert!(
            diff < 1e-4,
            "world size {world}, stage {stage} differs from stage 0 on 2 ranks by {diff}"
        );
    }
    let logged = |split: &str, epoch: usize, metric: &str| -> f64 {
        let text = std::fs::read_to_string(
            out.join(split)
                .join(format!("epoch-{epoch}"))
                .join(format!("{metric}.log")),
        )
        .unwrap();
        let values: Vec<f64> = text
            .lines()
            .map(|l| l.split(',').next().unwrap().parse().unwrap())
            .collect();
        values.iter().sum::<f64>() / values.len() as f64
    };
    // 32 sentences are 4 steps per epoch; measured 1.8 -> 1.2 on this tiny model.
    assert!(
        logged("train", 3, "Loss") < logged("train", 1, "Loss") * 0.9,
        "training loss did not fall"
    );
    assert!((0.0..=100.0).contains(&logged("valid", 3, "Accuracy")));
    let err = finetune_minilm_learner::run(finetune_minilm_learner::Args::parse_from([
        "finetune-minilm-learner",
        "--world-size",
        "3",
        "--batch-size",
        "8",
    ]))
    .err()
    .unwrap();
    assert!(err.contains("not a multiple of --world-size 3"), "{err}");
}

/// The evaluation is split over the ranks (a collective at stage 3, with a stand-in batch on
/// ranks that run out of sentences) and gives the same loss and accuracy at every world size.
#[test]
fn finetune_minilm_evaluation_is_the_same_at_every_world_size() {
    let model_dir = scratch("examples-tests", "minilm-model-eval");
    write_tiny_bert(&model_dir, &tiny_config());
    let eval_at = |world: &str| {
        let out = scratch("examples-tests", &format!("minilm-eval-{world}"));
        let summary = finetune_minilm::run(finetune_minilm::Args::parse_from([
            "finetune-minilm",
            "--world-size",
            world,
            "--stage",
            "3",
            "--model-dir",
            model_dir.to_str().unwrap(),
            "--limit-train",
            "12",
            "--limit-eval",
            "5",
            "--eval-batch-size",
            "2",
            "--batch-size",
            "12",
            "--steps",
            "1",
            "--dropout",
            "0",
            "--out",
            out.to_str().unwrap(),
        ]))
        .unwrap();
        let first = summary.metrics.rows[0].clone();
        (first.val_loss.unwrap(), first.val_accuracy.unwrap(), summary.accuracy)
    };
    let (loss1, acc1, after1) = eval_at("1");
    for world in ["3", "4"] {
        let (loss, acc, after) = eval_at(world);
        assert!(
            (loss - loss1).abs() < 1e-5,
            "world {world}: val loss {loss}, one rank {loss1}"
        );
        assert_eq!(acc, acc1, "world {world}");
        assert_eq!(after, after1, "world {world}, after one step");
    }
}

#[test]
fn max_grad_norm_reaches_the_optimizer() {
    // Clipped to a norm of 1e-9, every gradient element is far below AdamW's eps (1e-5), so 8
    // steps barely move the model; unclipped, the same 8 steps lower the validation loss.
    let val_change = |clip: Option<&str>| {
        let out = scratch("examples-tests", &format!("stories-clip-{}", clip.unwrap_or("none")));
        let out = out.to_str().unwrap();
        let mut extra = vec!["--world-size", "2", "--stage", "2", "--out", out];
        if let Some(clip) = clip {
            extra.extend_from_slice(&["--max-grad-norm", clip]);
        }
        let summary = finetune_stories::run(stories_args("8", &extra)).unwrap();
        let vals: Vec<f32> = summary.metrics.rows.iter().filter_map(|r| r.val_loss).collect();
        assert_eq!(vals.len(), 2, "before and after: {vals:?}");
        vals[1] - vals[0]
    };
    let clipped = val_change(Some("1e-9"));
    let free = val_change(None);
    assert!(clipped.abs() < 0.01, "clipped to 1e-9 the loss moved by {clipped}");
    assert!(free < -0.05, "unclipped the loss moved by {free}");
}

/// The examples' `--world-size`, `--stage` and checkpoint options alone.
#[derive(clap::Parser)]
struct CheckpointCli {
    #[command(flatten)]
    shard: burn_shard_examples::cli::ShardArgs,
}

/// A training run through the examples' `resume` and `save_if_due` (`TinyMlp`, 12 steps, one
/// step per global batch): resolves `--resume` first as the examples do. Returns the error of
/// the resolution or the run, as text.
fn checkpointed_run(options: &[&str], steps: usize) -> Result<(), String> {
    use burn::optim::AdamWConfig;
    use burn_shard::Stage;
    use burn_shard_comm::{Collective, InProcessGroup, run_ranks};
    use burn_shard_examples::training::{Progress, resume, save_if_due};

    use crate::common::{IN, OUT, TinyMlp, mse, rank_rows, rows, sharded_step};
    let mut args = CheckpointCli::parse_from(std::iter::once("example").chain(options.iter().copied())).shard;
    args.resolve_resume()?;
    let stage = args.stage_or(Stage::Two);
    let base = TinyMlp::new(&Device::flex().autodiff());
    let results = run_ranks(InProcessGroup::new(args.world_size).unwrap(), |comm| {
        let rank = comm.rank();
        let device = Device::flex().autodiff();
        let (model, mut optim) = args
            .shard_config(stage)
            .init(base.clone().fork(&device), AdamWConfig::new(), comm)?;
        let (mut model, start) = resume(&args, &mut optim, model, steps)?;
        let progress = Progress::new(rank, steps, start);
        let (lo, hi) = rank_rows(rank, args.world_size, 12);
        for step in start..steps {
            let (x, y) = crate::common::batch(step, 12);
            let loss = mse(&model, rows(&x, IN, lo, hi, &device), rows(&y, OUT, lo, hi, &device));
            model = sharded_step(&mut optim, model, loss, 1e-2).0;
            save_if_due(&args, &optim, &model, step + 1, steps, &progress)?;
        }
        Ok::<_, burn_shard::ShardError>(())
    })
    .map_err(|e| e.to_string())?;
    results
        .into_iter()
        .collect::<Result<Vec<()>, _>>()
        .map_err(|e| e.to_string())?;
    Ok(())
}

/// Issue #30, 1, through the examples' options: run A saves steps 4, 8 and 12 into DIR; run B
/// resumes from DIR/step-000004 into the same DIR with `--save-every 4` (A's names) or 3, and
/// `--keep 2`. B's saves succeed, A's later checkpoints are moved into DIR/abandoned-*/,
/// `--resume DIR` takes B's step 12. A run without `--resume` into DIR is refused.
#[test]
fn a_rollback_into_the_save_dir_continues_the_new_lineage() {
    use burn_shard::checkpoint::{ABANDONED_PREFIX, CheckpointMeta, list};
    for (world_size, stage) in [("1", "0"), ("3", "3")] {
        for every in ["4", "3"] {
            let root = scratch("examples-tests", &format!("rollback-{world_size}-{stage}-{every}"));
            let dir = root.to_str().unwrap();
            let common = ["--world-size", world_size, "--stage", stage, "--save-dir", dir];
            let with = |extra: &[&str]| -> Vec<String> { common.iter().chain(extra).map(|s| s.to_string()).collect() };
            let run = |extra: &[&str]| {
                let options = with(extra);
                checkpointed_run(&options.iter().map(String::as_str).collect::<Vec<_>>(), 12)
            };
            run(&["--save-every", "4"]).expect("run A");
            let a_run = CheckpointMeta::read(&root.join("step-000012"))
                .unwrap()
                .lineage
                .unwrap()
                .run;
            let refused = run(&["--save-every", "4"]).expect_err("a fresh run into a used --save-dir");
            assert!(refused.contains("already holds checkpoints"), "{refused}");
            let step4 = root.join("step-000004");
            run(&[
                "--save-every",
                every,
                "--keep",
                "2",
                "--resume",
                step4.to_str().unwrap(),
            ])
            .expect("run B: every save succeeds");
            let case = format!("world size {world_size}, stage {stage}, --save-every {every}");
            let listed: Vec<String> = list(&root)
                .unwrap()
                .iter()
                .map(|d| d.file_name().unwrap().to_string_lossy().into_owned())
                .collect();
            let expected = match every {
                "4" => ["step-000008", "step-000012"],
                _ => ["step-000009", "step-000012"],
            };
            assert_eq!(listed, expected, "{case}");
            // `--resume DIR` takes B's newest.
            let mut resumed = CheckpointCli::parse_from(["example", "--resume", dir]).shard;
            resumed.resolve_resume().unwrap();
            let newest = resumed.resume.unwrap();
            assert_eq!(newest, root.join("step-000012"), "{case}");
            let lineage = CheckpointMeta::read(&newest).unwrap().lineage.unwrap();
            assert_eq!(lineage.parent.as_deref(), Some("step-000004"), "{case}");
            assert_ne!(lineage.run, a_run, "{case}");
            // A's later checkpoints are still on disk, moved aside.
            let aside: Vec<_> = std::fs::read_dir(&root)
                .unwrap()
                .map(|e| e.unwrap().path())
                .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with(ABANDONED_PREFIX))
                .collect();
            assert_eq!(aside.len(), 1, "{case}: {aside:?}");
            for step in ["step-000008", "step-000012"] {
                let meta = CheckpointMeta::read(&aside[0].join(step)).unwrap();
                assert_eq!(meta.lineage.unwrap().run, a_run, "{case}: {step} is A's");
            }
        }
    }
}

/// `--resume auto` (what a job restarted by `burn-shard-run --max-restarts` passes): with no
/// checkpoint in `--save-dir` it starts afresh (missing directory included); with some, it
/// resumes from the newest, and the run's saves continue that lineage; a run whose newest
/// checkpoint is its last step ends without training (a rank failed on its way out); without
/// `--save-dir` it is refused, naming it.
#[test]
fn resume_auto_starts_afresh_then_resumes_the_newest_checkpoint() {
    use burn_shard::checkpoint::{CheckpointMeta, list};
    let root = scratch("examples-tests", "resume-auto");
    let dir = root.join("ckpt");
    let d = dir.to_str().unwrap();
    let options = [
        "--world-size",
        "2",
        "--stage",
        "3",
        "--save-dir",
        d,
        "--save-every",
        "4",
        "--keep",
        "10",
        "--resume",
        "auto",
    ];
    let name = |p: &std::path::PathBuf| p.file_name().unwrap().to_string_lossy().into_owned();

    let mut fresh = CheckpointCli::parse_from(std::iter::once("example").chain(options.iter().copied())).shard;
    fresh.resolve_resume().unwrap();
    assert_eq!(
        (fresh.resume.as_ref(), fresh.resumed_auto),
        (None, false),
        "no checkpoint: a fresh start"
    );
    checkpointed_run(&options, 8).expect("first run, 8 steps");
    assert_eq!(
        list(&dir).unwrap().iter().map(name).collect::<Vec<_>>(),
        ["step-000004", "step-000008"]
    );

    let mut again = CheckpointCli::parse_from(std::iter::once("example").chain(options.iter().copied())).shard;
    again.resolve_resume().unwrap();
    assert_eq!(again.resume, Some(dir.join("step-000008")));
    checkpointed_run(&options, 12).expect("the same job with more steps resumes at 8");
    let newest = CheckpointMeta::read(&dir.join("step-000012")).unwrap().lineage.unwrap();
    assert_eq!(
        newest.parent.as_deref(),
        Some("step-000008"),
        "continued from the newest"
    );

    checkpointed_run(&options, 12).expect("a finished run restarted ends without training");
    assert_eq!(list(&dir).unwrap().len(), 3, "nothing was saved again");

    let no_dir = checkpointed_run(&["--resume", "auto"], 4).unwrap_err();
    assert!(no_dir.contains("--save-dir"), "{no_dir}");
}
