/* tl_gemma.h - Gemma 3's text model in tiny_llama: what its config.json says
   and which tensors it has. The forward stages themselves are the engine's
   (tl_model.h), switched by the config fields this file fills.

   Part of tiny_llama.h: tl_hf.h's implementation includes it (it uses that
   file's JSON reader). Include tiny_llama.h, not this file.

   Gemma 3 (Gemma3ForCausalLM, model_type gemma3_text), as transformers
   defines it:
     layers     two kinds (layer_types): sliding_attention layers attend to
                the last sliding_window positions (the current one
                included), full_attention layers to every past position.
                Each kind has its own RoPE: rope_parameters.full_attention
                and .sliding_attention (transformers 5), or rope_theta,
                rope_scaling and rope_local_base_freq (transformers 4)
     attention  per-head RMSNorm of q and k before RoPE (q_norm, k_norm);
                softmax scale query_pre_attn_scalar^-0.5; head_dim need not
                be hidden_size / heads
     norms      RMSNorm scaling by (1 + weight), folded into the fp32 copies
                when the tensors are bound; four per layer: input (before
                attention), post_attention (the attention's output, before
                the residual add), pre_feedforward, post_feedforward (the
                FFN's output, before its residual add)
     FFN        GeGLU: down(gelu_tanh(gate x) * up x)
     embedding  the row times sqrt(hidden_size); the classifier is tied to
                it unless tie_word_embeddings is false
   Refused by name: logit soft-capping, bidirectional attention, attention
   biases, any other activation. */
#ifndef TL_GEMMA_H
#define TL_GEMMA_H

/* Norms and vectors a Gemma 3 layer keeps as fp32 copies (floats). */
#define TL__GEMMA_LAYER_FLOATS(c) (4 * (size_t)(c)->dim + 2 * (size_t)(c)->head_size)

/* ----------------------------------------------------------------------------
   config.json */

/* The RoPE of a layer kind (rope_parameters.<kind>) into theta and, for the
   full-attention layers, the scaling. The local layers' RoPE must be unscaled. */
static int tl__gemma_rope_kind(const char *s, const tl__jnode *nodes, int obj, const char *kind,
                               tl__rope_cfg *r, char *err, size_t errlen)
{
    char what[64];
    int v = tl__jget(s, nodes, obj, kind);
    snprintf(what, sizeof what, "rope_parameters.%s", kind);
    if (v < 0 || nodes[v].type == TL__J_NULL)
        return tl__fail(err, errlen, "config.json: %s is missing", what);
    return tl__hf_rope_obj(s, nodes, v, what, 1, r, err, errlen);
}

/* The Gemma 3 fields of a config.json into c (its sizes were read already);
   *tie gets tie_word_embeddings (default true). */
static int tl__gemma_config(const char *s, const tl__jnode *nodes, tl_config *c, int *tie, char *err,
                            size_t errlen)
{
    static const char *const off[] = {"final_logit_softcapping", "attn_logit_softcapping"};
    tl__rope_cfg full, local;
    char buf[64];
    double scalar = 256.0;
    int v, l, flag = 0, pattern = 0;
    size_t i;

    v = tl__jget(s, nodes, 0, "hidden_activation");
    if (v < 0)
        v = tl__jget(s, nodes, 0, "hidden_act");
    if (v >= 0 && (nodes[v].type != TL__J_STR || tl__jstr(s, &nodes[v], buf, sizeof buf) != 0 ||
                   strcmp(buf, "gelu_pytorch_tanh") != 0))
        return tl__fail(err, errlen, "config.json: hidden_activation must be \"gelu_pytorch_tanh\"");
    for (i = 0; i < sizeof off / sizeof off[0]; i++) {
        v = tl__jget(s, nodes, 0, off[i]);
        if (v >= 0 && nodes[v].type != TL__J_NULL)
            return tl__fail(err, errlen, "config.json: %s is not supported (it must be null)", off[i]);
    }
    if (tl__jcfg_bool(s, nodes, "use_bidirectional_attention", 0, &flag, err, errlen) || flag ||
        tl__jcfg_bool(s, nodes, "attention_bias", 0, &flag, err, errlen) || flag) {
        if (flag)
            tl__fail(err, errlen, "config.json: use_bidirectional_attention / attention_bias are not supported");
        return -1;
    }
    if (tl__jcfg_bool(s, nodes, "tie_word_embeddings", 1, tie, err, errlen) ||
        tl__jcfg_num(s, nodes, 0, "config", "query_pre_attn_scalar", 1e-6, 1e12, &scalar, NULL, err, errlen) ||
        tl__jcfg_int(s, nodes, "sliding_window", 1, 0, 1, 1 << 30, &c->sliding_window, err, errlen))
        return -1;
    c->attn_scale = (float)(1.0 / sqrt(scalar));
    c->embed_scale = (float)sqrt((double)c->dim);
    c->qk_norm = 1;
    c->ffn_act = TL_ACT_GELU_TANH;

    /* the kind of each layer: layer_types, or every pattern-th layer global */
    v = tl__jget(s, nodes, 0, "layer_types");
    if (v >= 0 && nodes[v].type != TL__J_NULL) {
        int e;
        if (nodes[v].type != TL__J_ARR || nodes[v].count != c->n_layers)
            return tl__fail(err, errlen, "config.json: layer_types must list the %d layers", c->n_layers);
        for (e = nodes[v].first, l = 0; e >= 0; e = nodes[e].next, l++) {
            if (nodes[e].type != TL__J_STR || tl__jstr(s, &nodes[e], buf, sizeof buf) != 0 ||
                (strcmp(buf, "sliding_attention") != 0 && strcmp(buf, "full_attention") != 0))
                return tl__fail(err, errlen, "config.json: layer_types[%d] is neither \"sliding_attention\" "
                                "nor \"full_attention\"", l);
            tl_set_layer_local(c, l, buf[0] == 's');
        }
    } else {
        if (tl__jcfg_int(s, nodes, "sliding_window_pattern", 0, 0, 1, 1 << 20, &pattern, err, errlen))
            return -1;
        if (!pattern && tl__jcfg_int(s, nodes, "_sliding_window_pattern", 0, 6, 1, 1 << 20, &pattern, err, errlen))
            return -1;
        for (l = 0; l < c->n_layers; l++)
            tl_set_layer_local(c, l, (l + 1) % pattern != 0);
    }

    /* RoPE: each kind its own */
    memset(&full, 0, sizeof full);
    memset(&local, 0, sizeof local);
    v = tl__jget(s, nodes, 0, "rope_parameters");
    if (v >= 0 && nodes[v].type == TL__J_OBJ && tl__jget(s, nodes, v, "full_attention") >= 0) {
        if (tl__gemma_rope_kind(s, nodes, v, "full_attention", &full, err, errlen) ||
            tl__gemma_rope_kind(s, nodes, v, "sliding_attention", &local, err, errlen))
            return -1;
    } else {
        double lb = 10000.0;
        if (v >= 0 && nodes[v].type != TL__J_NULL)
            return tl__fail(err, errlen, "config.json: rope_parameters must hold full_attention and "
                            "sliding_attention");
        full.theta = 1000000.0;
        if (tl__jcfg_num(s, nodes, 0, "config", "rope_theta", 1.0, 3.0e38, &full.theta, NULL, err, errlen) ||
            tl__jcfg_num(s, nodes, 0, "config", "rope_local_base_freq", 1.0, 3.0e38, &lb, NULL, err, errlen))
            return -1;
        full.theta_given = 1;
        local.theta = lb;
        local.theta_given = 1;
        v = tl__jget(s, nodes, 0, "rope_scaling");
        if (v >= 0 && nodes[v].type != TL__J_NULL && tl__hf_rope_obj(s, nodes, v, "rope_scaling", 0, &full, err, errlen))
            return -1;
    }
    if (local.scaling != TL_ROPE_SCALING_NONE)
        return tl__fail(err, errlen, "config.json: the sliding_attention layers' RoPE must be unscaled");
    c->rope_theta = full.theta_given ? (float)full.theta : 1000000.0f;
    c->rope_theta_local = local.theta_given ? (float)local.theta : 10000.0f;
    c->rope_scaling = full.scaling;
    if (full.scaling != TL_ROPE_SCALING_NONE)
        c->rope_factor = (float)full.factor;
    if (full.scaling == TL_ROPE_SCALING_LLAMA3) {
        c->rope_low_freq_factor = (float)full.low;
        c->rope_high_freq_factor = (float)full.high;
        c->rope_orig_ctx = (int)full.orig;
    }
    return 0;
}

/* ----------------------------------------------------------------------------
   Tensors */

/* A Gemma norm bound and folded: dst[i] = 1 + weight[i] */
static int tl__gemma_norm(const tl__binder *b, const char *name, long long n, float *dst)
{
    long long i;
    if (tl__bind_vec(b, name, n, dst))
        return -1;
    if (dst)
        for (i = 0; i < n; i++)
            dst[i] += 1.0f;
    return 0;
}

/* Layer l's norms into lw, their fp32 copies at *o (advanced; NULL: check only). */
static int tl__gemma_bind_layer(const tl__binder *b, int l, tl_layer_weights *lw, float **o)
{
    static const char *const names[6] = {"input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                                         "post_feedforward_layernorm", "self_attn.q_norm", "self_attn.k_norm"};
    const float **dst[6];
    char name[160];
    int i;
    dst[0] = &lw->rms_att;
    dst[1] = &lw->rms_post_att;
    dst[2] = &lw->rms_ffn;
    dst[3] = &lw->rms_post_ffn;
    dst[4] = &lw->q_norm;
    dst[5] = &lw->k_norm;
    for (i = 0; i < 6; i++) {
        long long n = i < 4 ? b->c->dim : b->c->head_size;
        snprintf(name, sizeof name, "model.layers.%d.%s.weight", l, names[i]);
        if (tl__gemma_norm(b, name, n, *o))
            return -1;
        *dst[i] = *o;
        if (*o)
            *o += n;
    }
    return 0;
}

#endif /* TL_GEMMA_H */
