// RUN: hspmd-opt %s -p 'apply-strategy{strategy="[0,1]: tp=2"}' | filecheck %s
// RUN: hspmd-opt %s -p 'apply-strategy{strategy="[0,1]: tp=2"},propagate-layouts' | filecheck %s --check-prefix=PROP

// Vocabulary parallelism: the embedding table is split along its vocabulary rows, the LM head
// (a column candidate whose matmul makes a cross-entropy's logits) along its vocabulary
// outputs, and the cross-entropy (with its gradient) is rewritten into ops whose rules keep the
// classes split: a two-level max over a [.., tp, V/tp] reshape, exp, sums, one_hot.
// Propagation then makes the lookup partial and the two class sums partial (all-reduced later).

builtin.module {
  func.func @train_step() {
    %table = graph.parameter "table" {init = "zeros"} : tensor<16x8xf32>
    %head = graph.parameter "head" {init = "zeros"} : tensor<8x16xf32>
    %ids = graph.input "ids" : tensor<2x4xi64>
    %targets = graph.input "targets" : tensor<2x4xi64>
    %x = graph.embedding %table, %ids : (tensor<16x8xf32>, tensor<2x4xi64>) -> tensor<2x4x8xf32>
    %logits = graph.matmul %x, %head : (tensor<2x4x8xf32>, tensor<8x16xf32>) -> tensor<2x4x16xf32>
    %loss = graph.softmax_cross_entropy %logits, %targets : (tensor<2x4x16xf32>, tensor<2x4xi64>) -> tensor<2x4xf32>
    %one = graph.constant {value = 1.000000e+00 : f64} : tensor<2x4xf32>
    %dlogits = graph.softmax_cross_entropy_grad %logits, %targets, %one : (tensor<2x4x16xf32>, tensor<2x4xi64>, tensor<2x4xf32>) -> tensor<2x4x16xf32>
    graph.output "loss", %loss : tensor<2x4xf32>
    graph.output "dlogits", %dlogits : tensor<2x4x16xf32>
    func.return
  }
}

// CHECK:      %table = graph.parameter "table" {init = "zeros"} : tensor<16x8xf32, #dist.layout<"[0,1]: split(0)=2">>
// CHECK-NEXT: %head = graph.parameter "head" {init = "zeros"} : tensor<8x16xf32, #dist.layout<"[0,1]: split(1)=2">>
// CHECK:      %logits = graph.matmul
// CHECK-NEXT: %[[CHUNKS:.*]] = graph.reshape %logits : (tensor<2x4x16xf32>) -> tensor<2x4x2x8xf32>
// CHECK-NEXT: %[[CMAX:.*]] = graph.reduce_max %[[CHUNKS]] {dims = array<i64: 3>}
// CHECK-NEXT: %[[MAX:.*]] = graph.reduce_max %[[CMAX]] {dims = array<i64: 2>}
// CHECK:      graph.exp
// CHECK:      graph.one_hot %targets
// CHECK:      graph.log
// CHECK-NOT:  graph.softmax_cross_entropy
// CHECK:      %dlogits = graph.mul
// CHECK-NEXT: graph.output "loss"

// PROP:      %x = graph.embedding {{.*}} -> tensor<2x4x8xf32, #dist.layout<"[0,1]: partial=2">>
// PROP:      graph.reduce_max {{.*}} {dims = array<i64: 3>} : (tensor<2x4x2x8xf32, #dist.layout<"[0,1]: split(2)=2">>) -> tensor<2x4x2xf32, #dist.layout<"[0,1]: split(2)=2">>
// PROP:      graph.one_hot %targets : {{.*}} -> tensor<2x4x16xf32, #dist.layout<"[0,1]: split(2)=2">>
// PROP:      graph.reduce_sum {{.*}} -> tensor<2x4xf32, #dist.layout<"[0,1]: partial=2">>
