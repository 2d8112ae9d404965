// SPDX-License-Identifier: Apache-2.0
#include "engine/tokenizer/tokenizer.h"

#include <filesystem>

#include "engine/core/error.h"
#include "engine/tokenizer/added_vocab.h"
#include "engine/tokenizer/bpe_model.h"
#include "engine/tokenizer/json_fields.h"
#include "engine/tokenizer/pipeline.h"
#include "engine/tokenizer/unicode.h"

namespace specula {

using tokenizer::AddedToken;
using tokenizer::AddedVocabulary;
using tokenizer::BpeModel;
using tokenizer::JsonView;
using tokenizer::TextSpan;

struct Tokenizer::Impl {
  std::string origin;
  BpeModel model;
  AddedVocabulary added;
  tokenizer::Normalizer normalizer;
  tokenizer::PreTokenizer pre_tokenizer;
  tokenizer::Decoder decoder;
  tokenizer::PostProcessor post_processor;
  SpecialTokenIds special;
  int32_t vocab_size = 0;

  explicit Impl(BpeModel m) : model(std::move(m)) {}

  std::optional<int32_t> token_to_id(std::string_view token) const {
    if (auto id = added.token_to_id(token)) return id;
    return model.token_to_id(token);
  }
  const std::string* id_to_token(int32_t id) const {
    if (const AddedToken* t = added.find(id)) return &t->content;
    return model.id_to_token(id);
  }
  void encode_plain(std::string_view raw, bool at_start, std::vector<int32_t>& ids) const;
};

namespace {

// A special token entry of tokenizer_config.json / special_tokens_map.json:
// a string or an AddedToken object {"content": ...}.
std::optional<std::string> special_token_string(const JsonView& config, std::string_view key) {
  auto v = config.find(key);
  if (!v) return std::nullopt;
  if (v->json().is_string()) return v->as_string();
  if (v->json().is_object()) return v->at("content").as_string();
  v->fail_here("expected a token string or {\"content\": ...}");
}

std::vector<int32_t> id_list(const JsonView& v) {
  std::vector<int32_t> out;
  const auto one = [&](const JsonView& x) {
    const int64_t id = x.as_int();
    if (id < 0 || id > INT32_MAX) x.fail_here(fmt::format("bad token id {}", id));
    out.push_back(static_cast<int32_t>(id));
  };
  if (v.json().is_array()) {
    for (size_t i = 0; i < v.json().size(); ++i) one(v.at(i));
  } else {
    one(v);
  }
  return out;
}

struct ConfigFiles {
  std::optional<nlohmann::json> tokenizer_config;
  std::string tokenizer_config_origin;
  std::optional<nlohmann::json> special_tokens_map;
  std::string special_tokens_map_origin;
  std::optional<nlohmann::json> generation_config;
  std::string generation_config_origin;
};

std::unique_ptr<Tokenizer::Impl> build(const nlohmann::json& root, const std::string& origin,
                                       const ConfigFiles& configs) {
  const JsonView top(root, origin, "");
  top.expect_object();
  const JsonView model_view = top.at("model");
  model_view.expect_object();
  if (!model_view.has("type") && !model_view.has("merges")) {
    model_view.fail_here("no \"type\" and no \"merges\": cannot tell the model type");
  }
  if (model_view.has("type")) {
    const std::string type = model_view.at("type").as_string();
    if (type != "BPE") {
      model_view.at("type").fail_here(
          fmt::format("unsupported model type '{}' (supported: BPE)", type));
    }
  }
  auto impl = std::make_unique<Tokenizer::Impl>(BpeModel::from_json(model_view));
  impl->origin = origin;

  const nlohmann::json null_json;
  const auto component = [&](std::string_view key) {
    auto v = top.find(key);
    return v ? *v : JsonView(null_json, origin, std::string(key));
  };
  impl->normalizer = tokenizer::Normalizer::from_json(component("normalizer"));
  impl->pre_tokenizer = tokenizer::PreTokenizer::from_json(component("pre_tokenizer"));
  impl->decoder = tokenizer::Decoder::from_json(component("decoder"));
  impl->post_processor = tokenizer::PostProcessor::from_json(component("post_processor"));

  std::vector<AddedToken> added;
  if (auto list = top.find("added_tokens")) {
    list->expect_array();
    for (size_t i = 0; i < list->json().size(); ++i) {
      const JsonView t = list->at(i);
      AddedToken token;
      token.content = t.at("content").as_string();
      token.special = t.bool_or("special", false);
      token.single_word = t.bool_or("single_word", false);
      token.lstrip = t.bool_or("lstrip", false);
      token.rstrip = t.bool_or("rstrip", false);
      token.normalized = t.bool_or("normalized", !token.special);
      if (t.has("id")) token.id = static_cast<int32_t>(t.at("id").as_int());
      added.push_back(std::move(token));
    }
  }
  const tokenizer::Normalizer& normalizer = impl->normalizer;
  impl->added.build(added, impl->model, [&normalizer](std::string_view s) {
    std::string out(s);
    normalizer.apply(out);
    return out;
  });
  impl->vocab_size = std::max(impl->model.max_id(), impl->added.max_id()) + 1;

  // Special tokens: tokenizer_config.json first, then special_tokens_map.json.
  const auto resolve = [&](std::string_view key) -> std::optional<int32_t> {
    for (int pass = 0; pass < 2; ++pass) {
      const auto& json = pass == 0 ? configs.tokenizer_config : configs.special_tokens_map;
      const auto& file =
          pass == 0 ? configs.tokenizer_config_origin : configs.special_tokens_map_origin;
      if (!json || !json->is_object()) continue;
      if (auto s = special_token_string(JsonView(*json, file, ""), key)) {
        if (auto id = impl->token_to_id(*s)) return id;
      }
    }
    return std::nullopt;
  };
  SpecialTokenIds& special = impl->special;
  special.bos = resolve("bos_token");
  special.pad = resolve("pad_token");
  special.unk = resolve("unk_token");
  if (!special.unk) special.unk = impl->model.unk_id();
  if (configs.generation_config && configs.generation_config->is_object()) {
    const JsonView gen(*configs.generation_config, configs.generation_config_origin, "");
    if (auto eos = gen.find("eos_token_id")) special.eos = id_list(*eos);
    if (!special.bos) {
      if (auto bos = gen.find("bos_token_id")) {
        const auto ids = id_list(*bos);
        if (!ids.empty()) special.bos = ids.front();
      }
    }
    if (!special.pad) {
      if (auto pad = gen.find("pad_token_id")) {
        const auto ids = id_list(*pad);
        if (!ids.empty()) special.pad = ids.front();
      }
    }
  }
  if (special.eos.empty()) {
    if (auto eos = resolve("eos_token")) special.eos.push_back(*eos);
  }

  // transformers rebuilds the template from add_bos_token / add_eos_token.
  if (configs.tokenizer_config && configs.tokenizer_config->is_object()) {
    const JsonView cfg(*configs.tokenizer_config, configs.tokenizer_config_origin, "");
    if (cfg.has("add_bos_token") || cfg.has("add_eos_token")) {
      const bool add_bos = cfg.find("add_bos_token") && cfg.at("add_bos_token").as_bool();
      const bool add_eos = cfg.find("add_eos_token") && cfg.at("add_eos_token").as_bool();
      std::vector<int32_t> bos, eos;
      if (add_bos) {
        auto id = resolve("bos_token");
        if (!id)
          cfg.at("add_bos_token").fail_here("is true but bos_token is missing or not in the vocab");
        bos.push_back(*id);
      }
      if (add_eos) {
        auto id = resolve("eos_token");
        if (!id)
          cfg.at("add_eos_token").fail_here("is true but eos_token is missing or not in the vocab");
        eos.push_back(*id);
      }
      impl->post_processor = tokenizer::PostProcessor::bos_eos(std::move(bos), std::move(eos));
    }
  }
  return impl;
}

}  // namespace

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Tokenizer Tokenizer::load(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::path file(path);
  if (fs::is_directory(file, ec)) file /= "tokenizer.json";
  if (!fs::exists(file, ec)) fail("{}: tokenizer.json not found", file.string());
  const fs::path dir = file.parent_path();
  ConfigFiles configs;
  const auto optional_json = [&](const char* name, std::optional<nlohmann::json>& dst,
                                 std::string& origin) {
    const fs::path p = dir / name;
    if (fs::exists(p, ec)) {
      origin = p.string();
      dst = tokenizer::read_json(origin);
    }
  };
  optional_json("tokenizer_config.json", configs.tokenizer_config, configs.tokenizer_config_origin);
  optional_json("special_tokens_map.json", configs.special_tokens_map,
                configs.special_tokens_map_origin);
  optional_json("generation_config.json", configs.generation_config,
                configs.generation_config_origin);
  const std::string origin = file.string();
  const nlohmann::json root = tokenizer::read_json(origin);
  return Tokenizer(build(root, origin, configs));
}

Tokenizer Tokenizer::from_json_text(std::string_view tokenizer_json,
                                    std::string_view tokenizer_config_json,
                                    std::string_view generation_config_json,
                                    const std::string& origin) {
  ConfigFiles configs;
  if (!tokenizer_config_json.empty()) {
    configs.tokenizer_config_origin = origin + " (tokenizer_config.json)";
    configs.tokenizer_config =
        tokenizer::parse_json(tokenizer_config_json, configs.tokenizer_config_origin);
  }
  if (!generation_config_json.empty()) {
    configs.generation_config_origin = origin + " (generation_config.json)";
    configs.generation_config =
        tokenizer::parse_json(generation_config_json, configs.generation_config_origin);
  }
  const nlohmann::json root = tokenizer::parse_json(tokenizer_json, origin);
  return Tokenizer(build(root, origin, configs));
}

void Tokenizer::Impl::encode_plain(std::string_view raw, bool at_start,
                                   std::vector<int32_t>& ids) const {
  std::string normalized(raw);
  normalizer.apply(normalized);
  if (normalized.empty()) return;
  thread_local std::vector<TextSpan> spans;
  std::vector<TextSpan> local;
  local.swap(spans);  // re-entrancy safe: take the scratch buffer for this call
  local.clear();
  if (added.has_tokens(true)) {
    added.split(normalized, true, local);
  } else {
    local.push_back(TextSpan{0, normalized.size(), -1});
  }
  std::vector<tokenizer::PreToken> words;
  for (const TextSpan& s : local) {
    if (s.id >= 0) {
      ids.push_back(s.id);
      continue;
    }
    const std::string_view piece = std::string_view(normalized).substr(s.begin, s.end - s.begin);
    if (pre_tokenizer.empty()) {
      model.tokenize(piece, ids);
      continue;
    }
    words.clear();
    words.push_back(tokenizer::PreToken{std::string(piece), at_start && s.begin == 0});
    pre_tokenizer.apply(words);
    for (const tokenizer::PreToken& w : words) model.tokenize(w.text, ids);
  }
  spans.swap(local);
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_special_tokens) const {
  tokenizer::validate_utf8(text, "Tokenizer::encode: input text");
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 4);
  if (impl_->added.has_tokens(false)) {
    std::vector<TextSpan> spans;
    impl_->added.split(text, false, spans);
    for (const TextSpan& s : spans) {
      if (s.id >= 0) {
        ids.push_back(s.id);
      } else {
        impl_->encode_plain(text.substr(s.begin, s.end - s.begin), s.begin == 0, ids);
      }
    }
  } else {
    impl_->encode_plain(text, true, ids);
  }
  if (add_special_tokens && impl_->post_processor.adds_tokens()) {
    ids = impl_->post_processor.apply(std::move(ids));
  }
  return ids;
}

PartialDecode Tokenizer::decode_partial(std::span<const int32_t> ids,
                                        bool skip_special_tokens) const {
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (int32_t id : ids) {
    const std::string* token = impl_->id_to_token(id);
    if (token == nullptr) continue;
    if (skip_special_tokens && impl_->added.is_special(*token)) continue;
    tokens.push_back(*token);
  }
  PartialDecode result;
  result.text = impl_->decoder.decode(std::move(tokens), &result.stable_bytes);
  return result;
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special_tokens) const {
  return decode_partial(ids, skip_special_tokens).text;
}

bool Tokenizer::decodes_to_text(int32_t id, bool skip_special_tokens) const {
  const std::string* token = impl_->id_to_token(id);
  return token != nullptr && !(skip_special_tokens && impl_->added.is_special(*token));
}

std::optional<int32_t> Tokenizer::token_to_id(std::string_view token) const {
  return impl_->token_to_id(token);
}

std::optional<std::string> Tokenizer::id_to_token(int32_t id) const {
  const std::string* token = impl_->id_to_token(id);
  if (token == nullptr) return std::nullopt;
  return *token;
}

int32_t Tokenizer::vocab_size() const {
  return impl_->vocab_size;
}

bool Tokenizer::is_special(int32_t id) const {
  const AddedToken* t = impl_->added.find(id);
  return t != nullptr && impl_->added.is_special(t->content);
}

const SpecialTokenIds& Tokenizer::special_ids() const {
  return impl_->special;
}

// ---------------------------------------------------------- StreamingDecoder

StreamingDecoder::StreamingDecoder(const Tokenizer& tokenizer, bool skip_special_tokens)
    : tokenizer_(&tokenizer), skip_special_tokens_(skip_special_tokens) {}

std::string StreamingDecoder::feed(int32_t id) {
  window_.push_back(id);
  PartialDecode d = tokenizer_->decode_partial(window_, skip_special_tokens_);
  std::string out;
  if (d.stable_bytes > emitted_ && d.stable_bytes <= d.text.size()) {
    out = d.text.substr(emitted_, d.stable_bytes - emitted_);
    emitted_ = d.stable_bytes;
  }
  // Once everything is final, keep only the last token that decodes to text:
  // it gives the next tokens their context (e.g. a Metaspace decoder treats
  // the first token specially) and its own text is subtracted via emitted_.
  if (d.stable_bytes == d.text.size() && window_.size() > 1) {
    size_t keep = window_.size();
    while (keep > 0 && !tokenizer_->decodes_to_text(window_[keep - 1], skip_special_tokens_))
      --keep;
    if (keep == 0) {
      window_.clear();
      emitted_ = 0;
    } else if (keep - 1 > 0) {
      std::vector<int32_t> trimmed(window_.begin() + static_cast<std::ptrdiff_t>(keep - 1),
                                   window_.end());
      PartialDecode t = tokenizer_->decode_partial(trimmed, skip_special_tokens_);
      if (t.stable_bytes == t.text.size()) {
        window_.swap(trimmed);
        emitted_ = t.text.size();
      }
    }
  }
  return out;
}

std::string StreamingDecoder::flush() {
  PartialDecode d = tokenizer_->decode_partial(window_, skip_special_tokens_);
  std::string out = emitted_ < d.text.size() ? d.text.substr(emitted_) : std::string();
  reset();
  return out;
}

void StreamingDecoder::reset() {
  window_.clear();
  emitted_ = 0;
}

}  // namespace specula
